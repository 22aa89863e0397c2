"""How cuda_ipc moves one transfer's segments: the choice of method and the launch plan (CPU only).

The methods (``transfer.cuda_ipc.method``):

- ``kernel``: one launch of the SM gather/scatter kernel (``cuda_kernels.py``) over all segments;
- ``copy_engine``: one ``cuMemcpyBatchAsync`` of all segments on the copy engines
  (``cuda_copy_engine.py``), no SMs taken from compute; one ``cuMemcpyAsync`` per segment where
  the driver has no batch call;
- ``memcpy``: one ``cuMemcpyAsync`` per segment (copy engines, one driver call each);
- ``auto``: ``memcpy`` below ``small_transfer_bytes`` in all, ``copy_engine`` when the segments
  average at least ``copy_engine_segment_bytes`` (long coalesced runs), else ``kernel``.

Nothing here touches the GPU, so all of it is tested on the CPU (``tests/unit/test_cuda_methods.py``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

KERNEL, COPY_ENGINE, MEMCPY, NONE = "kernel", "copy_engine", "memcpy", "none"


@dataclasses.dataclass(frozen=True, slots=True)
class Segments:
    """What the method choice and the launch need to know about one transfer's segments."""

    num_segments: int
    total_bytes: int
    uniform_bytes: int  # every segment has this size; 0 when sizes differ (or there are none)

    @property
    def mean_bytes(self) -> float:
        return self.total_bytes / self.num_segments if self.num_segments else 0.0


def describe(sizes: np.ndarray) -> Segments:
    """Count, total and common size of ``sizes`` (1-D int64, all > 0: the base class checked)."""
    n = int(sizes.size)
    if n == 0:
        return Segments(0, 0, 0)
    first = int(sizes[0])
    if n == 1:
        return Segments(1, first, first)
    if int(sizes.max()) == first and int(sizes.min()) == first:
        return Segments(n, n * first, first)
    return Segments(n, int(sizes.sum()), 0)


def choose(method: str, seg: Segments, *, small_transfer_bytes: int, copy_engine_segment_bytes: int) -> str:
    """The method that moves ``seg``: ``kernel``, ``copy_engine``, ``memcpy`` or ``none`` (no bytes)."""
    if seg.total_bytes == 0:
        return NONE
    if method != "auto":
        return method
    if seg.total_bytes < small_transfer_bytes:
        return MEMCPY
    if seg.mean_bytes >= copy_engine_segment_bytes:
        return COPY_ENGINE
    return KERNEL


def meta_entries(seg: Segments) -> int:
    """int64 entries of the kernel's metadata: src and dst offsets, plus n + 1 prefix sums unless uniform."""
    n = seg.num_segments
    return 2 * n if seg.uniform_bytes else 3 * n + 1


def fill_meta(
    view: np.ndarray, src_offsets: np.ndarray, dst_offsets: np.ndarray, sizes: np.ndarray, seg: Segments
) -> None:
    """Write ``[src_off (n), dst_off (n)]`` and, unless the sizes are uniform, ``start (n + 1)``.

    ``start`` holds the exclusive prefix sums of the sizes: segment k covers bytes
    ``start[k]:start[k + 1]`` of the transfer's byte stream.
    """
    n = seg.num_segments
    view[:n] = src_offsets
    view[n : 2 * n] = dst_offsets
    if not seg.uniform_bytes:
        view[2 * n] = 0
        np.cumsum(sizes, out=view[2 * n + 1 : 3 * n + 1])


@dataclasses.dataclass(frozen=True, slots=True)
class Grid:
    """One launch: ``ctas`` CTAs share ``num_chunks`` work items of ``chunk_bytes`` each."""

    ctas: int
    chunk_bytes: int
    num_chunks: int


def launch_grid(seg: Segments, capacity_ctas: int, chunk_bytes: int, max_ctas: int = 0) -> Grid:
    """The grid of one kernel launch.

    - ``capacity_ctas``: CTAs that fit on the GPU at once (occupancy x SMs). More would run in a
      second wave, and the first wave's CTAs would idle while it does.
    - ``chunk_bytes``: the bytes of one work item; 0 splits the transfer evenly over the CTAs.
      Smaller items are taken instead when there would be fewer items than CTAs.
    - Uniform segments no larger than an item get items of whole segments, so that no item pays
      for two segments' metadata.
    """
    assert seg.total_bytes > 0 and capacity_ctas > 0
    limit = min(capacity_ctas, max_ctas) if max_ctas > 0 else capacity_ctas
    total = seg.total_bytes
    even = -(-total // limit)  # the item size that gives every CTA one item
    chunk = even if chunk_bytes <= 0 else min(chunk_bytes, even)
    s = seg.uniform_bytes
    if s and s <= max(chunk, chunk_bytes):
        chunk = s * max(1, round(chunk / s))
    chunk = max(16, (chunk + 15) // 16 * 16)
    num_chunks = -(-total // chunk)
    return Grid(ctas=max(1, min(limit, num_chunks)), chunk_bytes=chunk, num_chunks=num_chunks)
