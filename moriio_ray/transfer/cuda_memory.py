"""GPU memory that cuda_ipc can export: dedicated allocations, IPC export and import.

A registered tensor is exported as the CUDA IPC handle of the allocation holding it plus the offset
of the tensor inside that allocation (a tensor of torch's caching allocator is usually inside a
bigger segment). ``CudaRegion`` travels in ``MemoryDesc.backend_data`` as msgpack. An importer in
another process opens the handle; one in the same process (tests, benchmarks, two engines in one
process) cannot, and uses the exporter's pointer directly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import msgspec
import torch

from moriio_ray.errors import ConfigError, IncompatiblePeer, MoriioRayError, TransferError
from moriio_ray.transfer import cuda_driver
from moriio_ray.transfer.cuda_kernels import cupy_module


class CudaRegion(msgspec.Struct, frozen=True):
    """What a peer needs to map one registered GPU region."""

    handle: bytes  # cudaIpcMemHandle_t of the allocation holding the region
    offset: int  # the region's first byte inside that allocation
    ptr: int  # the region's address in the exporting process (used by same-process peers)
    device_uuid: str
    num_bytes: int = 0  # the registered size (a descriptor's num_bytes could be forged or stale)


def allocation_range(ptr: int, device_index: int) -> tuple[int, int]:
    """(base address, size in bytes) of the device allocation containing ``ptr``, seen from a GPU."""
    cp = cupy_module()
    rt = cp.cuda.runtime
    previous = rt.getDevice()
    # cudaSetDevice also makes the device's primary context current in this thread, which the
    # driver call below needs (a fresh thread has none, even where getDevice() already says so).
    rt.setDevice(device_index)
    try:
        return cuda_driver.address_range(ptr)
    except TransferError as exc:
        raise ConfigError(f"tensor: address {ptr:#x} is not device memory of this process ({exc})") from None
    finally:
        rt.setDevice(previous)


def allocate(num_bytes: int, device: torch.device) -> torch.Tensor:
    """A zeroed uint8 tensor in its own cudaMalloc allocation (exportable; freed when the tensor dies)."""
    cp = cupy_module()
    assert device.index is not None
    with cp.cuda.Device(device.index):
        mem = cp.cuda.memory.Memory(max(num_bytes, 1))
        array = cp.ndarray((num_bytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
        tensor = torch.from_dlpack(array)  # keeps ``array`` (and so the allocation) alive
    tensor.zero_()
    return tensor


@contextlib.contextmanager
def _runtime_on(device_index: int, error: type[MoriioRayError], message: str) -> Iterator[Any]:
    """CuPy's CUDA runtime with ``device_index`` current; a runtime error raises ``error`` with
    ``message``, its ``{cause}`` filled in."""
    cp = cupy_module()
    with cp.cuda.Device(device_index):
        try:
            yield cp.cuda.runtime
        except cp.cuda.runtime.CUDARuntimeError as exc:
            raise error(message.format(cause=exc)) from exc


def export_region(tensor: torch.Tensor, device_uuid: str) -> CudaRegion:
    """The IPC description of a contiguous GPU tensor."""
    assert tensor.device.index is not None
    ptr = tensor.data_ptr()
    base, _ = allocation_range(ptr, tensor.device.index)
    why = (
        "tensor: its memory cannot be exported through CUDA IPC ({cause}); allocate it with "
        "agent.allocate (expandable segments and managed memory cannot be exported)"
    )
    with _runtime_on(tensor.device.index, ConfigError, why) as rt:
        handle = bytes(rt.ipcGetMemHandle(base))
    num_bytes = tensor.numel() * tensor.element_size()
    return CudaRegion(handle=handle, offset=ptr - base, ptr=ptr, device_uuid=device_uuid, num_bytes=num_bytes)


def open_handle(handle: bytes, device_index: int) -> tuple[int, int]:
    """Map a peer's allocation into this process for kernels on ``device_index``: (base, size)."""
    why = (
        "cannot open the peer's CUDA IPC handle ({cause}); the peer must run on this host with its "
        f"GPU visible here and P2P-reachable from GPU {device_index} (for Ray actors: "
        "runtime_env env_vars ray_actor_env())"
    )
    with _runtime_on(device_index, IncompatiblePeer, why) as rt:
        # default flags: cudaIpcMemLazyEnablePeerAccess, so a handle of another GPU works too
        base = int(rt.ipcOpenMemHandle(handle))
    _, size = allocation_range(base, device_index)
    return base, size


def close_handle(base: int, device_index: int) -> None:
    """Unmap what ``open_handle`` mapped."""
    cp = cupy_module()
    with cp.cuda.Device(device_index):
        cp.cuda.runtime.ipcCloseMemHandle(base)
