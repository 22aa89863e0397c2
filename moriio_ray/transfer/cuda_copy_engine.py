"""Copy-engine submission of many segments: ``cuMemcpyBatchAsync``, or one ``cuMemcpyAsync`` each.

A batch is one driver call for all N segments: the copy engines move them, and no SM is taken
from the kernels the engine runs meanwhile. The driver entry point depends on its version:

- ``cuMemcpyBatchAsync_v2`` (CUDA 13): ``(dsts, srcs, sizes, count, attrs, attrIdxs, numAttrs, stream)``;
- ``cuMemcpyBatchAsync`` (CUDA 12.8/12.9): the same with a ``failIdx`` pointer before the stream.

Where neither exists, or the first batch is refused, the submitter falls back to one
``cuMemcpyAsync`` per segment and records why in ``reason`` (benchmarks print it).
"""

from __future__ import annotations

import ctypes

import numpy as np

from moriio_ray.transfer import cuda_driver as drv
from moriio_ray.transfer.plan import Copy

BATCH_V2, BATCH_V1, PER_SEGMENT = "batch_v2", "batch_v1", "per_segment"


class CopyEngine:
    """Submits segment copies on one device's stream (callers hold the stream's lock).

    ``prefer_overlap`` sets ``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE`` on the batch: a hint to
    keep the copies on the copy engines where the driver would otherwise pick SMs.
    """

    def __init__(self, device_index: int, *, prefer_overlap: bool = False, batch: bool = True) -> None:
        self.device_index = device_index
        self.reason = ""
        if not batch:
            self.mode, self.reason = PER_SEGMENT, "batch submission switched off"
        elif drv.has("cuMemcpyBatchAsync_v2"):
            self.mode = BATCH_V2
        elif drv.has("cuMemcpyBatchAsync"):
            self.mode = BATCH_V1
        else:
            self.mode, self.reason = PER_SEGMENT, "this CUDA driver has no cuMemcpyBatchAsync (CUDA < 12.8)"
        hint = drv.CUmemLocation(drv.CU_MEMLOCATION_TYPE_DEVICE, device_index)
        flags = drv.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE if prefer_overlap else 0
        self._attrs = drv.CUmemcpyAttributes(drv.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, hint, hint, flags)
        self._attr_idx = (ctypes.c_size_t * 1)(0)
        self._fail_idx = ctypes.c_size_t(0)
        self._srcs = np.empty(0, dtype=np.int64)  # persistent, so their addresses are taken once
        self._dsts = np.empty(0, dtype=np.int64)
        self._srcs_ptr = self._dsts_ptr = 0

    def _grow(self, n: int) -> None:
        cap = 1 << max(10, (n - 1).bit_length())
        self._srcs = np.empty(cap, dtype=np.int64)
        self._dsts = np.empty(cap, dtype=np.int64)
        self._srcs_ptr, self._dsts_ptr = self._srcs.ctypes.data, self._dsts.ctypes.data

    def copy(self, src_ptr: int, dst_ptr: int, copy: Copy, stream: int) -> None:
        """Enqueue ``dst_ptr + dst_offsets[i] <- src_ptr + src_offsets[i]`` for all i on ``stream``."""
        sizes = copy.sizes
        n = int(sizes.size)
        if self.mode == PER_SEGMENT:
            self.copy_each(src_ptr, dst_ptr, copy, stream)
            return
        if n > self._srcs.size:
            self._grow(n)
        np.add(copy.src_offsets, src_ptr, out=self._srcs[:n])
        np.add(copy.dst_offsets, dst_ptr, out=self._dsts[:n])
        assert sizes.dtype == np.int64 and sizes.flags.c_contiguous  # read as size_t (all > 0)
        attrs, idx = ctypes.byref(self._attrs), self._attr_idx
        if self.mode == BATCH_V2:
            f = drv.fn("cuMemcpyBatchAsync_v2")
            rc = f(self._dsts_ptr, self._srcs_ptr, sizes.ctypes.data, n, attrs, idx, 1, stream)
        else:
            f = drv.fn("cuMemcpyBatchAsync")
            fail = ctypes.byref(self._fail_idx)
            rc = f(self._dsts_ptr, self._srcs_ptr, sizes.ctypes.data, n, attrs, idx, 1, fail, stream)
        if rc == drv.CUDA_SUCCESS:
            return
        if not self.reason:  # the first refusal: say why, and copy segment by segment from now on
            self.reason = f"{self.mode} refused: {drv.error_name(rc)} ({rc})"
            self.mode = PER_SEGMENT
            self.copy_each(src_ptr, dst_ptr, copy, stream)
            return
        drv.check(rc, self.mode)

    @staticmethod
    def copy_each(src_ptr: int, dst_ptr: int, copy: Copy, stream: int) -> None:
        """One ``cuMemcpyAsync`` per segment."""
        f = drv.fn("cuMemcpyAsync")
        for so, do, sz in zip(*(a.tolist() for a in copy), strict=True):
            rc = f(dst_ptr + do, src_ptr + so, sz, stream)
            if rc != drv.CUDA_SUCCESS:
                drv.check(rc, "cuMemcpyAsync")
