"""One-launch gather/scatter copy of many byte segments between two GPU buffers (CUDA via NVRTC).

The kernel moves N segments ``src[src_off[i]:+size[i]] -> dst[dst_off[i]:+size[i]]`` in one launch.

- **Work items.** The byte stream of all segments (in order) is cut into items of ``chunk_bytes``
  (``cuda_methods.launch_grid``), so uneven segment sizes balance by themselves. CTAs take items from
  a counter (``dynamic``), so a CTA that starts late, on an SM busy with decode, takes fewer.
- **Grid.** As many CTAs as fit on the GPU at once (the driver's occupancy), never a second wave.
- **Finding a segment.** Uniform sizes: by division. Otherwise one warp searches the prefix sums,
  32 entries per step.
- **Copying.** 16-byte loads and stores where source and destination agree modulo 16, else 8-, 4- or
  1-byte accesses; unaligned heads and tails go byte by byte. ``unroll`` loads are in flight per
  thread before their stores.
- **Metadata.** ``meta = [src_off (n), dst_off (n)]`` plus ``start (n + 1)`` (exclusive prefix sums)
  unless the sizes are uniform, int64, written into a ring of pinned buffers and uploaded with one
  host-to-device copy (or read by the kernel straight from pinned memory: ``meta_in_host``).
- **Launch.** ``cuLaunchKernel`` through ctypes with a prebuilt argument array (``cuda_driver``).

CuPy compiles the kernel with NVRTC (it is imported here only, and only when cuda_ipc is chosen).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from typing import Any

import numpy as np
import torch

from moriio_ray.errors import BackendUnavailable
from moriio_ray.transfer import cuda_driver
from moriio_ray.transfer.cuda_methods import Grid, Segments, describe, fill_meta, launch_grid, meta_entries
from moriio_ray.transfer.plan import Copy

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

// The last k in [0, n) with start[k] <= c0 (start[0] = 0 <= c0, strictly increasing), found by
// the 32 lanes of one warp together: each round tests 32 evenly spaced entries, so a search over
// n segments takes ceil(log32(n)) + 1 dependent loads instead of log2(n).
__device__ __forceinline__ int warp_search(const i64* __restrict__ start, int n, i64 c0) {
  const int lane = threadIdx.x & 31;
  int lo = 0, hi = n;
  while (hi - lo > 32) {
    const int step = (hi - lo + 31) / 32;
    const int idx = lo + lane * step;
    const bool le = idx < hi && start[idx] <= c0;
    const int m = __popc(__ballot_sync(0xffffffffu, le));  // lanes 0..m-1 hold (monotone), m >= 1
    lo += (m - 1) * step;
    hi = min(lo + step, hi);
  }
  const int idx = lo + lane;
  const bool le = idx < hi && start[idx] <= c0;
  return lo + __popc(__ballot_sync(0xffffffffu, le)) - 1;
}

// meta = [src_off (n), dst_off (n)] and, unless seg_bytes > 0 (all segments that size), start (n + 1).
// The transfer's byte stream is cut into num_chunks items of `chunk` bytes. With DYNAMIC, CTAs take
// items from counters[0] until none is left, so CTAs that start late (SMs busy with other work) take
// fewer; the CTA that ends last zeroes both counters for the next launch on the same stream.
extern "C" __global__ void __launch_bounds__(THREADS) segment_copy(
    const char* __restrict__ src, char* __restrict__ dst, const i64* __restrict__ meta,
    int n, i64 total, i64 chunk, i64 num_chunks, i64 seg_bytes, u64* counters) {
  const i64* src_off = meta;
  const i64* dst_off = meta + n;
  const i64* start = meta + 2 * (i64)n;
#if DYNAMIC
  __shared__ i64 s_item;
#endif
  __shared__ int s_seg;
  i64 c = blockIdx.x;
  for (;;) {
#if DYNAMIC
    if (threadIdx.x == 0) s_item = (i64)atomicAdd(counters, 1ULL);
    __syncthreads();
    c = s_item;
    __syncthreads();
#endif
    if (c >= num_chunks) break;
    const i64 c0 = c * chunk;
    const i64 c1 = c0 + chunk < total ? c0 + chunk : total;
    int k;
    if (seg_bytes > 0) {
      k = (int)(c0 / seg_bytes);
    } else {
      if (threadIdx.x < 32) {
        k = warp_search(start, n, c0);
        if (threadIdx.x == 0) s_seg = k;
      }
      __syncthreads();
      k = s_seg;
      __syncthreads();
    }
    for (i64 pos = c0; pos < c1; ++k) {
      const i64 s0 = seg_bytes > 0 ? (i64)k * seg_bytes : start[k];
      const i64 s1 = seg_bytes > 0 ? s0 + seg_bytes : start[k + 1];
      const i64 end = s1 < c1 ? s1 : c1;
      copy_piece<UNROLL>(src + src_off[k] + (pos - s0), dst + dst_off[k] + (pos - s0), end - pos);
      pos = end;
    }
#if !DYNAMIC
    c += gridDim.x;
#endif
  }
#if DYNAMIC
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(counters + 1, 1ULL) == (u64)gridDim.x - 1) {  // every CTA has drawn its last item
      counters[0] = 0;
      counters[1] = 0;
    }
  }
#endif
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
    threads: int = 512  # per CTA, 32..1024
    chunk_bytes: int = 64 << 10  # bytes per work item; 0: split the transfer evenly over the CTAs
    dynamic: bool = True  # CTAs take work items from a counter (else item i goes to CTA i mod grid)
    streaming: bool = False  # evict-first cache hints on loads and stores
    ctas_per_sm: int = 0  # 0: as many as fit (occupancy); else at most this many per SM
    meta_in_host: bool = False  # the kernel reads the offsets from pinned host memory (no upload)

    def label(self) -> str:
        kind = "dyn" if self.dynamic else "static"
        return (
            f"u{self.unroll}-t{self.threads}-ch{self.chunk_bytes >> 10}k-{kind}"
            f"{'-stream' if self.streaming else ''}{f'-c{self.ctas_per_sm}' if self.ctas_per_sm else ''}"
            f"{'-hostmeta' if self.meta_in_host else ''}"
        )


DEFAULT_VARIANT = KernelVariant()


@functools.cache
def _kernel(device_index: int, unroll: int, streaming: bool, dynamic: bool, threads: int) -> Any:
    cp = cupy_module()
    with cp.cuda.Device(device_index):
        options = (
            f"-DUNROLL={unroll}",
            f"-DSTREAMING={int(streaming)}",
            f"-DDYNAMIC={int(dynamic)}",
            f"-DTHREADS={threads}",
        )
        kernel = cp.RawKernel(_SOURCE, "segment_copy", options=options)
        kernel.compile()
    return kernel


class _Slot:
    """One pinned staging buffer for the metadata, its device twin, and the event after its last use."""

    def __init__(self) -> None:
        self.host: torch.Tensor | None = None
        self.host_view: np.ndarray | None = None
        self.dev: torch.Tensor | None = None
        self.used: cuda_driver.RawEvent | None = None


class SegmentCopier:
    """Launches the segment-copy kernel on one device and one stream (callers hold a lock per stream).

    ``copy`` must run with the device's primary context current (``cuda_driver.ContextGuard``).
    ``launcher="cupy"`` launches through CuPy instead of ``cuLaunchKernel`` (for comparison).
    """

    SLOTS = 16

    def __init__(
        self,
        device: torch.device,
        stream: torch.cuda.Stream,
        variant: KernelVariant | None = None,
        max_ctas: int = 0,
        launcher: str = "driver",
    ) -> None:
        cp = cupy_module()
        assert device.index is not None
        self.device = device
        self.stream = stream
        self.stream_handle = int(stream.cuda_stream)
        self.variant = v = variant or DEFAULT_VARIANT
        assert 32 <= v.threads <= 1024 and v.threads % 32 == 0
        self.launcher = launcher
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._kernel = _kernel(device.index, v.unroll, v.streaming, v.dynamic, v.threads)
        with cp.cuda.Device(device.index):  # CuPy loads the module for its current device
            self.function = int(self._kernel.kernel.ptr)
        self.ctx = cuda_driver.primary_context(device.index)
        with cuda_driver.ContextGuard(self.ctx):
            per_sm = cuda_driver.occupancy(self.function, v.threads)
        if v.ctas_per_sm > 0:
            per_sm = min(per_sm, v.ctas_per_sm)
        self.capacity = max(1, per_sm) * self.num_sms
        self.max_ctas = max_ctas
        with torch.cuda.device(device), torch.cuda.stream(stream):
            self._counters = torch.zeros(2, dtype=torch.int64, device=device)  # u64 item, done
        self._cp = cp
        self._cp_stream = cp.cuda.ExternalStream(self.stream_handle, device.index)
        self._slots = [_Slot() for _ in range(self.SLOTS)]
        self._next = 0
        c = ctypes
        # (src, dst, meta, n, total, chunk, num_chunks, seg_bytes, counters), as the kernel takes them
        self._args: list[Any] = [c.c_uint64(), c.c_uint64(), c.c_uint64(), c.c_int32()]
        self._args += [c.c_int64(), c.c_int64(), c.c_int64(), c.c_int64()]
        self._args.append(c.c_uint64(self._counters.data_ptr()))
        self._argv = (c.c_void_p * len(self._args))(*[c.addressof(a) for a in self._args])
        self._launch = cuda_driver.fn("cuLaunchKernel")

    def _stage(self, copy: Copy, seg: Segments) -> tuple[int, _Slot]:
        """Metadata into a ring slot (and up to the device unless ``meta_in_host``): its address, the slot."""
        slot = self._slots[self._next]
        self._next = (self._next + 1) % self.SLOTS
        if slot.used is not None and not slot.used.query():
            slot.used.synchronize()  # the slot's last kernel still reads it
        need = meta_entries(seg)
        if slot.host is None or slot.host_view is None or slot.host.numel() < need:
            cap = 1 << max(12, (need - 1).bit_length())
            slot.host = torch.empty(cap, dtype=torch.int64, pin_memory=True)
            slot.host_view = slot.host.numpy()
            # allocated on the copy stream, so the caching allocator reuses it only after our kernels
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                slot.dev = torch.empty(cap, dtype=torch.int64, device=self.device)
            slot.used = cuda_driver.RawEvent()
        fill_meta(slot.host_view, copy.src_offsets, copy.dst_offsets, copy.sizes, seg)
        if self.variant.meta_in_host:
            return int(slot.host.data_ptr()), slot  # pinned memory is device-addressable (UVA)
        assert slot.dev is not None
        dev_ptr = int(slot.dev.data_ptr())
        cuda_driver.memcpy_htod_async(dev_ptr, int(slot.host.data_ptr()), need * 8, self.stream_handle)
        return dev_ptr, slot

    def copy(self, src_ptr: int, dst_ptr: int, copy: Copy, seg: Segments | None = None) -> Grid:
        """Enqueue the copy of all segments on ``self.stream`` (one upload, one launch)."""
        seg = seg or describe(copy.sizes)
        assert seg.num_segments > 0
        meta_ptr, slot = self._stage(copy, seg)
        grid = launch_grid(seg, self.capacity, self.variant.chunk_bytes, self.max_ctas)
        values = [src_ptr, dst_ptr, meta_ptr, seg.num_segments, seg.total_bytes, grid.chunk_bytes]
        values += [grid.num_chunks, seg.uniform_bytes]
        if self.launcher == "cupy":
            with self._cp.cuda.Device(self.device.index):
                args = (np.uint64(values[0]), np.uint64(values[1]), np.uint64(values[2]), np.int32(values[3]))
                args += (*(np.int64(x) for x in values[4:]), np.uint64(self._counters.data_ptr()))
                self._kernel((grid.ctas,), (self.variant.threads,), args, stream=self._cp_stream)
        else:
            for holder, value in zip(self._args[:8], values, strict=True):  # the 9th never changes
                holder.value = value
            threads, stream = self.variant.threads, self.stream_handle
            rc = self._launch(self.function, grid.ctas, 1, 1, threads, 1, 1, 0, stream, self._argv, None)
            cuda_driver.check(rc, "cuLaunchKernel(segment_copy)")
        assert slot.used is not None
        slot.used.record(self.stream_handle)
        return grid
