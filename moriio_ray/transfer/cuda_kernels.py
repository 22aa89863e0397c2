"""One-launch gather/scatter copy of many byte segments between two GPU buffers (CUDA via NVRTC).

The kernel moves N segments ``src[src_off[i]:+size[i]] -> dst[dst_off[i]:+size[i]]`` in one launch.
The byte stream of all segments (in order) is cut into equal chunks, one per CTA, so that uneven
segment sizes balance by themselves; a CTA finds its first segment by a binary search over the
prefix sums. Each piece is copied with 16-byte loads and stores when source and destination agree
modulo 16, else with 8-, 4- or 1-byte accesses; unaligned heads and tails go byte by byte.

The offsets reach the device in one small host-to-device copy from pinned memory:
``meta = [src_off (n), dst_off (n), start (n + 1)]`` as int64, ``start`` the exclusive prefix sums.

CuPy compiles and launches the kernel (it is imported here only, and only when cuda_ipc is chosen).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from moriio_ray.errors import BackendUnavailable

THREADS = 512
# A CTA gets at least this many bytes: less would leave most of its threads idle.
MIN_CTA_BYTES = THREADS * 16 * 2

_SOURCE = r"""
typedef long long i64;
typedef unsigned long long u64;

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
    for (int u = 0; u < U; ++u) r[u] = sv[i + u * bd];
#pragma unroll
    for (int u = 0; u < U; ++u) dv[i + u * bd] = r[u];
  }
  for (; i < n; i += bd) dv[i] = sv[i];
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


@functools.cache
def _kernel(device_index: int, unroll: int) -> Any:
    cp = cupy_module()
    with cp.cuda.Device(device_index):
        kernel = cp.RawKernel(_SOURCE, "segment_copy", options=(f"-DUNROLL={unroll}",))
        kernel.compile()
    return kernel


def build_meta(src_offsets: np.ndarray, dst_offsets: np.ndarray, sizes: np.ndarray) -> torch.Tensor:
    """The kernel's metadata in a pinned host tensor: [src_off (n), dst_off (n), start (n + 1)] int64."""
    n = int(sizes.size)
    meta = torch.empty(3 * n + 1, dtype=torch.int64, pin_memory=True)
    view = meta.numpy()
    view[:n] = src_offsets
    view[n : 2 * n] = dst_offsets
    view[2 * n] = 0
    np.cumsum(sizes, out=view[2 * n + 1 :])
    return meta


def launch_grid(total_bytes: int, num_sms: int, ctas_per_sm: int, max_ctas: int) -> tuple[int, int]:
    """(number of CTAs, bytes per CTA chunk, a multiple of 16) for one copy of ``total_bytes``."""
    limit = max_ctas if max_ctas > 0 else num_sms * ctas_per_sm
    ctas = max(1, min(limit, -(-total_bytes // MIN_CTA_BYTES)))
    chunk = -(-total_bytes // ctas)
    chunk = (chunk + 15) // 16 * 16
    return -(-total_bytes // chunk), chunk


class SegmentCopier:
    """Launches the segment-copy kernel on one device and one stream."""

    def __init__(
        self,
        device: torch.device,
        stream: torch.cuda.Stream,
        *,
        unroll: int = 4,
        ctas_per_sm: int = 4,
        max_ctas: int = 0,
    ) -> None:
        cp = cupy_module()
        assert device.index is not None
        self.device = device
        self.stream = stream
        self.max_ctas = max_ctas
        self.ctas_per_sm = ctas_per_sm
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._kernel = _kernel(device.index, unroll)
        self._cp_stream = cp.cuda.ExternalStream(stream.cuda_stream, device.index)
        self._cp = cp

    def copy(
        self, src_ptr: int, dst_ptr: int, src_offsets: np.ndarray, dst_offsets: np.ndarray, sizes: np.ndarray
    ) -> torch.Tensor:
        """Enqueue the copy on ``self.stream``; returns the device metadata, to keep alive until done.

        Must be called with ``self.stream`` current (the metadata is allocated on it).
        """
        total = int(sizes.sum())
        n = int(sizes.size)
        assert n > 0 and total > 0
        host_meta = build_meta(src_offsets, dst_offsets, sizes)
        dev_meta = torch.empty_like(host_meta, device=self.device)
        dev_meta.copy_(host_meta, non_blocking=True)
        ctas, chunk = launch_grid(total, self.num_sms, self.ctas_per_sm, self.max_ctas)
        args = (
            np.uint64(src_ptr),
            np.uint64(dst_ptr),
            np.uint64(dev_meta.data_ptr()),
            np.int32(n),
            np.int64(total),
            np.int64(chunk),
        )
        with self._cp.cuda.Device(self.device.index):
            self._kernel((ctas,), (THREADS,), args, stream=self._cp_stream)
        return dev_meta

    def copy_each(
        self, src_ptr: int, dst_ptr: int, src_offsets: np.ndarray, dst_offsets: np.ndarray, sizes: np.ndarray
    ) -> None:
        """One cudaMemcpyAsync per segment (copy engines): the small-transfer path."""
        memcpy = self._cp.cuda.runtime.memcpyAsync
        kind = self._cp.cuda.runtime.memcpyDefault
        handle = self.stream.cuda_stream
        with self._cp.cuda.Device(self.device.index):
            for so, do, sz in zip(src_offsets.tolist(), dst_offsets.tolist(), sizes.tolist(), strict=True):
                memcpy(dst_ptr + do, src_ptr + so, sz, kind, handle)
