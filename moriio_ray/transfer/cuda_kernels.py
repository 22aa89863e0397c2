"""One-launch gather/scatter copy of many byte segments between two GPU buffers (CUDA via NVRTC).

The kernel moves N segments ``src[src_off[i]:+size[i]] -> dst[dst_off[i]:+size[i]]`` in one launch.
The byte stream of all segments (in order) is cut into equal chunks, one per CTA, so that uneven
segment sizes balance by themselves; a CTA finds its first segment by a binary search over the
prefix sums. Each piece is copied with 16-byte loads and stores when source and destination agree
modulo 16, else with 8-, 4- or 1-byte accesses; unaligned heads and tails go byte by byte.

The offsets reach the device in one small host-to-device copy from a pinned buffer (a ring of them,
reused once their upload ran):
``meta = [src_off (n), dst_off (n), start (n + 1)]`` as int64, ``start`` the exclusive prefix sums.

CuPy compiles and launches the kernel (it is imported here only, and only when cuda_ipc is chosen).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import torch

from moriio_ray.errors import BackendUnavailable

_SOURCE = r"""
typedef long long i64;
typedef unsigned long long u64;

#if STREAMING  // evict-first cache hints: the bytes are touched once
#define LD(p) __ldcs(p)
#define ST(p, v) __stcs((p), (v))
#else
#define LD(p) (*(p))
#define ST(p, v) (*(p) = (v))
#endif

template <typename V, int U>
__device__ __forceinline__ void copy_aligned(const char* __restrict__ s, char* __restrict__ d, i64 len) {
  // s and d are both aligned to sizeof(V) here.
  const V* sv = reinterpret_cast<const V*>(s);
  V* dv = reinterpret_cast<V*>(d);
  const i64 n = len / (i64)sizeof(V);
  const i64 bd = blockDim.x;
  i64 i = threadIdx.x;
  // U independent loads in flight per thread before their stores: remote (NVLink) loads are slow.
  for (; i + (U - 1) * bd < n; i += U * bd) {
    V r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) r[u] = LD(sv + i + u * bd);
#pragma unroll
    for (int u = 0; u < U; ++u) ST(dv + i + u * bd, r[u]);
  }
  for (; i < n; i += bd) ST(dv + i, LD(sv + i));
  for (i64 j = n * (i64)sizeof(V) + threadIdx.x; j < len; j += bd) d[j] = s[j];
}

template <int U>
__device__ __forceinline__ void copy_piece(const char* s, char* d, i64 len) {
  const u64 mis = ((u64)s) ^ ((u64)d);
  const int w = (mis & 15) == 0 ? 16 : (mis & 7) == 0 ? 8 : (mis & 3) == 0 ? 4 : 1;
  i64 head = (i64)((w - ((u64)s & (u64)(w - 1))) & (u64)(w - 1));
  if (head > len) head = len;
  for (i64 j = threadIdx.x; j < head; j += blockDim.x) d[j] = s[j];
  s += head;
  d += head;
  len -= head;
  switch (w) {
    case 16: copy_aligned<uint4, U>(s, d, len); break;
    case 8: copy_aligned<uint2, U>(s, d, len); break;
    case 4: copy_aligned<unsigned int, U>(s, d, len); break;
    default: copy_aligned<unsigned char, U>(s, d, len); break;
  }
}

extern "C" __global__ void __launch_bounds__(512) segment_copy(
    const char* __restrict__ src, char* __restrict__ dst, const i64* __restrict__ meta,
    int n, i64 total, i64 chunk) {
  const i64* src_off = meta;
  const i64* dst_off = meta + n;
  const i64* start = meta + 2 * (i64)n;
  for (i64 c0 = (i64)blockIdx.x * chunk; c0 < total; c0 += (i64)gridDim.x * chunk) {
    const i64 c1 = c0 + chunk < total ? c0 + chunk : total;
    // the segment holding byte c0: the last k with start[k] <= c0 (sizes are > 0)
    int lo = 0, hi = n - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (start[mid] <= c0) lo = mid; else hi = mid - 1;
    }
    i64 pos = c0;
    for (int k = lo; pos < c1; ++k) {
      const i64 s0 = start[k];
      const i64 end = start[k + 1] < c1 ? start[k + 1] : c1;
      copy_piece<UNROLL>(src + src_off[k] + (pos - s0), dst + dst_off[k] + (pos - s0), end - pos);
      pos = end;
    }
  }
}
"""


def cupy_module() -> Any:
    """CuPy, or BackendUnavailable saying how to get it."""
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailable(
            "transfer.backend: cuda_ipc needs CuPy for its copy kernel and IPC handles; "
            "install the CuPy wheel that matches your CUDA (e.g. pip install cupy-cuda12x)"
        ) from exc
    return cupy


@dataclasses.dataclass(frozen=True)
class KernelVariant:
    """Launch shape of the copy kernel (chosen by measurement: bench/transfer_gpu_bench.py sweeps it)."""

    unroll: int = 4  # 16-byte loads in flight per thread before their stores
    ctas_per_sm: int = 4
    threads: int = 512  # per CTA, at most 512
    chunk_bytes: int = 0  # bytes per CTA work item; 0: split the transfer evenly over the CTAs
    streaming: bool = False  # evict-first cache hints on loads and stores


DEFAULT_VARIANT = KernelVariant()


@functools.cache
def _kernel(device_index: int, unroll: int, streaming: bool) -> Any:
    cp = cupy_module()
    with cp.cuda.Device(device_index):
        options = (f"-DUNROLL={unroll}", f"-DSTREAMING={int(streaming)}")
        kernel = cp.RawKernel(_SOURCE, "segment_copy", options=options)
        kernel.compile()
    return kernel


def fill_meta(view: np.ndarray, src_offsets: np.ndarray, dst_offsets: np.ndarray, sizes: np.ndarray) -> int:
    """Write [src_off (n), dst_off (n), start (n + 1)] into ``view``; returns the total bytes."""
    n = int(sizes.size)
    view[:n] = src_offsets
    view[n : 2 * n] = dst_offsets
    view[2 * n] = 0
    np.cumsum(sizes, out=view[2 * n + 1 : 3 * n + 1])
    return int(view[3 * n])


def launch_grid(total_bytes: int, num_sms: int, variant: KernelVariant, max_ctas: int = 0) -> tuple[int, int]:
    """(number of CTAs, bytes per CTA work item, a multiple of 16) for one copy of ``total_bytes``."""
    limit = max_ctas if max_ctas > 0 else num_sms * variant.ctas_per_sm
    if variant.chunk_bytes > 0:
        chunk = variant.chunk_bytes
    else:
        # at least two full passes of the CTA's threads each: fewer bytes leave threads idle
        ctas = max(1, min(limit, -(-total_bytes // (variant.threads * 32))))
        chunk = -(-total_bytes // ctas)
    chunk = (chunk + 15) // 16 * 16
    return max(1, min(limit, -(-total_bytes // chunk))), chunk


class _Slot:
    """One pinned staging buffer for the metadata and its device twin (reused round-robin)."""

    def __init__(self) -> None:
        self.host: torch.Tensor | None = None
        self.dev: torch.Tensor | None = None
        self.staged: torch.cuda.Event | None = None  # the host-to-device copy out of ``host``


class SegmentCopier:
    """Launches the segment-copy kernel on one device and one stream."""

    SLOTS = 8

    def __init__(
        self,
        device: torch.device,
        stream: torch.cuda.Stream,
        variant: KernelVariant | None = None,
        max_ctas: int = 0,
    ) -> None:
        cp = cupy_module()
        assert device.index is not None
        self.device = device
        self.stream = stream
        self.variant = variant or DEFAULT_VARIANT
        assert 32 <= self.variant.threads <= 512
        self.max_ctas = max_ctas
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._kernel = _kernel(device.index, self.variant.unroll, self.variant.streaming)
        self._cp = cp
        self._cp_stream = cp.cuda.ExternalStream(stream.cuda_stream, device.index)
        self._slots = [_Slot() for _ in range(self.SLOTS)]
        self._next = 0

    def _stage(self, src_offsets: np.ndarray, dst_offsets: np.ndarray, sizes: np.ndarray) -> tuple[int, int]:
        """Copy the metadata to the device on the stream; returns (device address, total bytes)."""
        slot = self._slots[self._next]
        self._next = (self._next + 1) % self.SLOTS
        need = 3 * int(sizes.size) + 1
        if slot.staged is not None:
            slot.staged.synchronize()  # the host buffer is free again once its last upload ran
        if slot.host is None or slot.host.numel() < need:
            cap = 1 << max(12, (need - 1).bit_length())
            slot.host = torch.empty(cap, dtype=torch.int64, pin_memory=True)
            # allocated on the copy stream, so the caching allocator reuses it only after our kernels
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                slot.dev = torch.empty(cap, dtype=torch.int64, device=self.device)
            slot.staged = torch.cuda.Event()
        assert slot.dev is not None and slot.staged is not None
        total = fill_meta(slot.host.numpy(), src_offsets, dst_offsets, sizes)
        rt = self._cp.cuda.runtime
        rt.memcpyAsync(
            slot.dev.data_ptr(),
            slot.host.data_ptr(),
            need * 8,
            rt.memcpyHostToDevice,
            self.stream.cuda_stream,
        )
        slot.staged.record(self.stream)
        return slot.dev.data_ptr(), total

    def copy(
        self, src_ptr: int, dst_ptr: int, src_offsets: np.ndarray, dst_offsets: np.ndarray, sizes: np.ndarray
    ) -> None:
        """Enqueue the copy of all segments on ``self.stream`` (one upload, one launch)."""
        n = int(sizes.size)
        assert n > 0
        with self._cp.cuda.Device(self.device.index):
            meta_ptr, total = self._stage(src_offsets, dst_offsets, sizes)
            ctas, chunk = launch_grid(total, self.num_sms, self.variant, self.max_ctas)
            args = (
                np.uint64(src_ptr),
                np.uint64(dst_ptr),
                np.uint64(meta_ptr),
                np.int32(n),
                np.int64(total),
                np.int64(chunk),
            )
            self._kernel((ctas,), (self.variant.threads,), args, stream=self._cp_stream)

    def copy_each(
        self, src_ptr: int, dst_ptr: int, src_offsets: np.ndarray, dst_offsets: np.ndarray, sizes: np.ndarray
    ) -> None:
        """One cudaMemcpyAsync per segment (copy engines): the small-transfer path."""
        rt = self._cp.cuda.runtime
        handle = self.stream.cuda_stream
        with self._cp.cuda.Device(self.device.index):
            for so, do, sz in zip(src_offsets.tolist(), dst_offsets.tolist(), sizes.tolist(), strict=True):
                rt.memcpyAsync(dst_ptr + do, src_ptr + so, sz, rt.memcpyDefault, handle)
