"""Which GPUs a cuda_ipc worker sees, which one it uses, and peer access between them.

Ray narrows ``CUDA_VISIBLE_DEVICES`` to the GPUs it assigned to an actor. A CUDA IPC handle can only
be opened in a process that sees the exporting GPU, so a cuda_ipc worker on GPU 1 could not import
memory of GPU 0. The fix has two halves:

- ``ray_actor_env()``: the ``runtime_env`` env_vars for cuda_ipc workers. They tell Ray not to set
  ``CUDA_VISIBLE_DEVICES``, so the actor sees every GPU of its host (Ray still accounts ``num_gpus``)::

      Worker.options(num_gpus=1, runtime_env={"env_vars": ray_actor_env()}).remote(...)

- ``select_device()``: inside the actor, picks the GPU that Ray assigned (``get_accelerator_ids``)
  among the visible ones and makes it the current device. Outside Ray it keeps the current device.
"""

from __future__ import annotations

import sys

import torch

from moriio_ray import env
from moriio_ray.errors import BackendUnavailable, ConfigError, IncompatiblePeer

# Ray 2.x: when set to 1, Ray leaves CUDA_VISIBLE_DEVICES alone in workers
# (ray/_private/accelerators/nvidia_gpu.py, NOSET_CUDA_VISIBLE_DEVICES_ENV_VAR).
RAY_NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def ray_actor_env() -> dict[str, str]:
    """``runtime_env={"env_vars": ray_actor_env()}`` for cuda_ipc workers: they see all host GPUs."""
    return {RAY_NOSET_CUDA_VISIBLE_DEVICES: "1"}


def _ray_gpu_ids() -> list[str]:
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return []
    try:
        ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
    except Exception:  # the driver, or a worker without GPUs
        return []
    return [str(i) for i in ids]


def local_index(gpu_id: str, visible: str | None) -> int:
    """The torch index of the host GPU ``gpu_id`` (as Ray names it) given ``CUDA_VISIBLE_DEVICES``."""
    if visible is None or visible.strip() == "":
        try:
            return int(gpu_id)
        except ValueError:
            raise ConfigError(
                f"gpu id: {gpu_id!r} is not an index and CUDA_VISIBLE_DEVICES is unset"
            ) from None
    names = [v.strip() for v in visible.split(",") if v.strip()]
    if gpu_id not in names:
        raise ConfigError(
            f"CUDA_VISIBLE_DEVICES: Ray assigned GPU {gpu_id}, which is not among the visible "
            f"{visible!r}; start cuda_ipc workers with runtime_env env_vars ray_actor_env()"
        )
    return names.index(gpu_id)


def select_device() -> torch.device:
    """Make the GPU Ray assigned to this actor the current device and return it.

    Outside Ray (or without an assigned GPU) the current CUDA device is kept. With several GPUs
    assigned, the first one is used.
    """
    if not torch.cuda.is_available():
        raise BackendUnavailable("device: cuda_ipc needs a CUDA GPU and none is visible in this process")
    ids = _ray_gpu_ids()
    index = local_index(sorted(ids)[0], env.cuda_visible_devices()) if ids else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"device: GPU index {index} is beyond the {torch.cuda.device_count()} visible GPUs; "
            "start cuda_ipc workers with runtime_env env_vars ray_actor_env()"
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def device_uuids() -> list[str]:
    """The UUIDs of the visible GPUs, in torch index order (they name a GPU across processes)."""
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def index_of_uuid(uuid: str) -> int:
    """The torch index of the GPU with this UUID, or IncompatiblePeer saying how to make it visible."""
    uuids = device_uuids()
    if uuid not in uuids:
        raise IncompatiblePeer(
            f"GPU {uuid} of the peer is not visible in this process (CUDA_VISIBLE_DEVICES="
            f"{env.cuda_visible_devices()!r}); cuda_ipc workers must see the host's GPUs: start Ray "
            "actors with runtime_env env_vars ray_actor_env() and pick the GPU with select_device()"
        )
    return uuids.index(uuid)


_peer_enabled: set[tuple[int, int]] = set()


def enable_peer_access(a: int, b: int) -> None:
    """Let kernels on GPU ``a`` access GPU ``b``'s memory and back (NVLink or PCIe P2P)."""
    if a == b or (a, b) in _peer_enabled:
        return
    if not (torch.cuda.can_device_access_peer(a, b) and torch.cuda.can_device_access_peer(b, a)):
        raise IncompatiblePeer(
            f"GPUs {a} and {b} cannot access each other's memory (no P2P between them); "
            "use the tcp or shm backend for this pair"
        )
    # A device-to-device copy makes torch enable peer access (it tolerates 'already enabled',
    # which a raw cudaDeviceEnablePeerAccess would leave behind as a sticky last error).
    x = torch.zeros(1, device=f"cuda:{a}")
    y = torch.zeros(1, device=f"cuda:{b}")
    x.copy_(y)
    y.copy_(x)
    torch.cuda.synchronize(a)
    torch.cuda.synchronize(b)
    _peer_enabled.update({(a, b), (b, a)})
