"""The few CUDA driver calls that cuda_ipc's hot path makes, through ctypes on ``libcuda.so.1``.

Why not CuPy or torch for these: a CuPy kernel launch, a torch event record or a torch stream switch
each cost several microseconds of Python; one ctypes call costs about one. The driver library is
loaded on first use only, so importing this module loads nothing.

Every call checks its ``CUresult`` and raises ``TransferError`` naming the call and the error.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from moriio_ray.errors import TransferError

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
CU_EVENT_DISABLE_TIMING = 0x2
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CU_MEMLOCATION_TYPE_DEVICE = 1
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 0x1

_vp, _u32, _i32, _sz = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_size_t

# name -> (argtypes); every function returns CUresult (int)
_SIGNATURES: dict[str, list[Any]] = {
    "cuGetErrorName": [_i32, ctypes.POINTER(ctypes.c_char_p)],
    "cuCtxGetCurrent": [ctypes.POINTER(_vp)],
    "cuCtxPushCurrent_v2": [_vp],
    "cuCtxPopCurrent_v2": [ctypes.POINTER(_vp)],
    "cuDeviceGet": [ctypes.POINTER(_i32), _i32],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_vp), _i32],
    "cuEventCreate": [ctypes.POINTER(_vp), _u32],
    "cuEventDestroy_v2": [_vp],
    "cuEventRecord": [_vp, _vp],
    "cuEventQuery": [_vp],
    "cuEventSynchronize": [_vp],
    "cuStreamWaitEvent": [_vp, _vp, _u32],
    "cuLaunchKernel": [_vp, _u32, _u32, _u32, _u32, _u32, _u32, _u32, _vp, _vp, _vp],
    "cuMemcpyAsync": [ctypes.c_uint64, ctypes.c_uint64, _sz, _vp],
    "cuMemcpyHtoDAsync_v2": [ctypes.c_uint64, _vp, _sz, _vp],
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": [ctypes.POINTER(_i32), _vp, _i32, _sz],
    "cuMemGetAddressRange_v2": [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(_sz), ctypes.c_uint64],
    # CUDA 13: (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream)
    "cuMemcpyBatchAsync_v2": [_vp, _vp, _vp, _sz, _vp, _vp, _sz, _vp],
    # CUDA 12.8/12.9: the same with a failIdx pointer before the stream
    "cuMemcpyBatchAsync": [_vp, _vp, _vp, _sz, _vp, _vp, _sz, _vp, _vp],
}


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", CUmemLocation),
        ("dstLocHint", CUmemLocation),
        ("flags", ctypes.c_uint),
    ]


@functools.lru_cache(maxsize=1)
def libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


@functools.cache
def fn(name: str) -> Any:
    """The driver function ``name`` with its argument types set; AttributeError if absent."""
    f = getattr(libcuda(), name)
    f.argtypes = _SIGNATURES[name]
    f.restype = ctypes.c_int
    return f


def has(name: str) -> bool:
    """Whether this driver exports ``name``."""
    try:
        fn(name)
    except AttributeError:
        return False
    return True


def error_name(rc: int) -> str:
    name = ctypes.c_char_p()
    if fn("cuGetErrorName")(rc, ctypes.byref(name)) != CUDA_SUCCESS or not name.value:
        return f"CUDA error {rc}"
    return name.value.decode()


def check(rc: int, what: str) -> None:
    if rc != CUDA_SUCCESS:
        raise TransferError(f"{what} failed: {error_name(rc)} ({rc})")


def current_context() -> int:
    ctx = _vp()
    check(fn("cuCtxGetCurrent")(ctypes.byref(ctx)), "cuCtxGetCurrent")
    return int(ctx.value or 0)


def primary_context(device_index: int) -> int:
    """The primary context of a visible device (the one torch and CuPy use), retained for good."""
    dev = _i32()
    check(fn("cuDeviceGet")(ctypes.byref(dev), device_index), "cuDeviceGet")
    ctx = _vp()
    check(fn("cuDevicePrimaryCtxRetain")(ctypes.byref(ctx), dev.value), "cuDevicePrimaryCtxRetain")
    return int(ctx.value or 0)


class ContextGuard:
    """Makes ``ctx`` current in this thread for a ``with`` block, only if it is not already."""

    __slots__ = ("_ctx", "_pushed")

    def __init__(self, ctx: int) -> None:
        self._ctx = ctx
        self._pushed = False

    def __enter__(self) -> None:
        if current_context() != self._ctx:
            check(fn("cuCtxPushCurrent_v2")(self._ctx), "cuCtxPushCurrent")
            self._pushed = True

    def __exit__(self, *exc: object) -> None:
        if self._pushed:
            self._pushed = False
            fn("cuCtxPopCurrent_v2")(ctypes.byref(_vp()))


class RawEvent:
    """A driver event without timing (cheaper to record than a torch event); destroyed with the object."""

    __slots__ = ("handle",)

    def __init__(self) -> None:
        ev = _vp()
        check(fn("cuEventCreate")(ctypes.byref(ev), CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        self.handle = int(ev.value or 0)

    def record(self, stream: int) -> None:
        check(fn("cuEventRecord")(self.handle, stream), "cuEventRecord")

    def query(self) -> bool:
        rc = fn("cuEventQuery")(self.handle)
        if rc == CUDA_ERROR_NOT_READY:
            return False
        check(rc, "cuEventQuery")
        return True

    def synchronize(self) -> None:
        check(fn("cuEventSynchronize")(self.handle), "cuEventSynchronize")

    def __del__(self) -> None:
        try:
            fn("cuEventDestroy_v2")(self.handle)
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass


def stream_wait(stream: int, event: RawEvent) -> None:
    check(fn("cuStreamWaitEvent")(stream, event.handle, 0), "cuStreamWaitEvent")


def memcpy_htod_async(dst: int, src_host: int, num_bytes: int, stream: int) -> None:
    check(fn("cuMemcpyHtoDAsync_v2")(dst, src_host, num_bytes, stream), "cuMemcpyHtoDAsync")


def occupancy(function: int, threads: int) -> int:
    """How many CTAs of ``threads`` threads of a kernel fit on one SM at once."""
    n = _i32()
    check(
        fn("cuOccupancyMaxActiveBlocksPerMultiprocessor")(ctypes.byref(n), function, threads, 0),
        "cuOccupancyMaxActiveBlocksPerMultiprocessor",
    )
    return int(n.value)


def address_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the allocation holding ``ptr``; raises TransferError if it is none of ours."""
    base = ctypes.c_uint64(0)
    size = _sz(0)
    check(
        fn("cuMemGetAddressRange_v2")(ctypes.byref(base), ctypes.byref(size), ptr),
        f"cuMemGetAddressRange({ptr:#x})",
    )
    return int(base.value), int(size.value or 0)
