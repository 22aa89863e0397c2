"""The boundary with ``mori.io``: importing it, and turning our config into MoRI's objects.

Nothing here imports ``mori`` at module level: ``import_mori_io`` does it when a MoRI agent is
created, so ``import moriio_ray`` and every other backend work on hosts without ``amd-mori``.

Written against amd-mori 1.2.4. Every name that this module, ``mori.py`` and ``mori_status.py`` use
is checked against the API read from the real 1.2.4 wheel (``tests/unit/test_mori_surface.py``):
classes, methods with their arity, keyword arguments and enum members. It has not run on AMD
hardware here.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import msgspec

from moriio_ray.config import MoriConfig
from moriio_ray.errors import BackendUnavailable, IncompatiblePeer

INSTALL_HINT = (
    "install amd-mori (pip install 'moriio-ray[rocm]', which pulls amd-mori>=1.2.4) on a ROCm host, "
    "or choose another transfer.backend (tcp, shm, cuda_ipc)"
)

# What this adapter needs beyond older releases: timed waits, and MoRI's own peer-failure reports.
_NEEDED = (("IOEngine", "wait_all"), ("IOEngine", "pop_peer_failure"), ("IOEngineSession", "alive"))


def import_mori_io() -> ModuleType:
    """``mori.io`` (amd-mori 1.2.4 or newer), or BackendUnavailable saying how to get it."""
    try:
        mori_io = importlib.import_module("mori.io")
    except (ImportError, OSError) as exc:  # OSError: its native libraries (HIP, ibverbs) do not load
        raise BackendUnavailable(
            f"transfer.backend: 'mori' needs the mori package, which does not import here ({exc}); "
            f"{INSTALL_HINT}"
        ) from exc
    for cls, method in _NEEDED:
        if not hasattr(getattr(mori_io, cls), method):
            raise BackendUnavailable(
                f"transfer.backend: 'mori': this amd-mori has no {cls}.{method}, which moriio-ray "
                "needs; upgrade with pip install 'amd-mori>=1.2.4'"
            )
    return mori_io


def mori_engine_key(key: str, epoch: int, pid: int) -> str:
    """The IOEngine key: engine key + epoch + pid, so that a restarted peer never reuses a stale key."""
    return f"{key}@e{epoch}@p{pid}"


def backend_type(mori_io: ModuleType, config: MoriConfig) -> Any:
    """MoRI's ``BackendType`` member for ``transfer.mori.backend``."""
    return mori_io.BackendType.XGMI if config.backend == "xgmi" else mori_io.BackendType.RDMA


def backend_config(mori_io: ModuleType, config: MoriConfig) -> Any:
    """``RdmaBackendConfig`` or ``XgmiBackendConfig`` carrying every knob of ``transfer.mori``."""
    if config.backend == "xgmi":
        return mori_io.XgmiBackendConfig(
            num_streams=config.xgmi_num_streams, num_events=config.xgmi_num_events
        )
    poll_mode = mori_io.PollCqMode.EVENT if config.poll_cq_mode == "event" else mori_io.PollCqMode.POLLING
    return mori_io.RdmaBackendConfig(
        qp_per_transfer=config.qp_per_transfer,
        post_batch_size=config.post_batch_size,
        num_worker_threads=config.num_workers,
        poll_cq_mode=poll_mode,
        # Off by default: with notifications on, an ENOMEM from ibv_post_send on the
        # notification poisoned the transfer status before the data completed (vLLM saw hangs).
        enable_notification=config.enable_notification,
    )


class MoriPeerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What our EngineDesc.backend_data carries for a MoRI agent.

    ``engine`` is MoRI's own ``EngineDesc.pack()`` bytes. ``kind`` (rdma | xgmi) travels with it
    because our EngineDesc says only "mori", and an rdma agent cannot reach an xgmi one.
    """

    kind: str
    engine: bytes


def encode_peer_info(kind: str, packed_engine: bytes) -> bytes:
    return msgspec.msgpack.encode(MoriPeerInfo(kind=kind, engine=bytes(packed_engine)))


def decode_peer_info(peer_key: str, data: bytes) -> MoriPeerInfo:
    """Parse a peer's backend_data, or IncompatiblePeer naming the peer."""
    try:
        return msgspec.msgpack.decode(data, type=MoriPeerInfo)
    except msgspec.DecodeError as exc:
        raise IncompatiblePeer(
            f"peer {peer_key!r}: its descriptor carries no MoRI engine ({exc}); "
            "run the same moriio-ray version with transfer.backend: mori on every engine"
        ) from None
