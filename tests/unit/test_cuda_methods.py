"""cuda_ipc's CPU side: the method choice, the kernel's metadata, its launch grid, and a model of
how the kernel walks the work items (the same arithmetic as ``segment_copy``), so every byte is
shown to be copied exactly once for any grid the planner makes."""

from __future__ import annotations

import numpy as np
import pytest

from moriio_ray.config import CudaIpcConfig, TransferConfig
from moriio_ray.errors import ConfigError
from moriio_ray.transfer.cuda_methods import (
    COPY_ENGINE,
    KERNEL,
    MEMCPY,
    NONE,
    Grid,
    Segments,
    choose,
    describe,
    fill_meta,
    launch_grid,
    meta_entries,
)

KiB, MiB = 1 << 10, 1 << 20
AUTO = dict(small_transfer_bytes=64 * KiB, copy_engine_segment_bytes=1 * MiB)


def test_describe_tells_uniform_sizes_from_mixed_ones() -> None:
    assert describe(np.zeros(0, np.int64)) == Segments(0, 0, 0)
    assert describe(np.array([5], np.int64)) == Segments(1, 5, 5)
    assert describe(np.full(512, 32 * KiB, np.int64)) == Segments(512, 512 * 32 * KiB, 32 * KiB)
    assert describe(np.array([32, 64, 32], np.int64)) == Segments(3, 128, 0)
    assert describe(np.array([64, 32, 32], np.int64)).uniform_bytes == 0


@pytest.mark.parametrize(
    ("sizes", "method"),
    [
        ([], NONE),
        ([32 * KiB], MEMCPY),  # 32 KiB in all: below small_transfer_bytes
        ([32 * KiB] * 512, KERNEL),  # paged KV: many short segments
        ([4 * MiB] * 8, COPY_ENGINE),  # long coalesced runs
        ([2 << 30], COPY_ENGINE),  # one big contiguous segment
        ([2 * MiB, 16 * KiB, 16 * KiB], KERNEL),  # mean just under the threshold
    ],
)
def test_auto_picks_by_total_and_mean_segment_size(sizes: list[int], method: str) -> None:
    assert choose("auto", describe(np.array(sizes, np.int64)), **AUTO) == method


@pytest.mark.parametrize("method", ["kernel", "copy_engine", "memcpy"])
def test_a_named_method_is_used_for_every_nonempty_transfer(method: str) -> None:
    for sizes in ([1], [32 * KiB] * 512, [2 << 30]):
        assert choose(method, describe(np.array(sizes, np.int64)), **AUTO) == method
    assert choose(method, describe(np.zeros(0, np.int64)), **AUTO) == NONE


def test_config_names_the_method_field_and_its_choices() -> None:
    assert TransferConfig(backend="cuda_ipc").cuda_ipc.method == "auto"
    assert CudaIpcConfig(method="COPY_ENGINE").method == "copy_engine"
    with pytest.raises(ConfigError, match=r"method: 'dma' is not one of auto, kernel, copy_engine, memcpy"):
        CudaIpcConfig(method="dma")
    with pytest.raises(ConfigError, match="copy_engine_segment_bytes: 0 must be >= 1"):
        CudaIpcConfig(copy_engine_segment_bytes=0)


def test_fill_meta_writes_offsets_and_prefix_sums_unless_uniform() -> None:
    src = np.array([10, 20, 30], np.int64)
    dst = np.array([1, 2, 3], np.int64)
    mixed = np.array([4, 8, 16], np.int64)
    seg = describe(mixed)
    view = np.full(16, -1, np.int64)
    fill_meta(view, src, dst, mixed, seg)
    assert meta_entries(seg) == 10
    assert view[:10].tolist() == [10, 20, 30, 1, 2, 3, 0, 4, 12, 28]
    same = np.full(3, 8, np.int64)
    useg = describe(same)
    view[:] = -1
    fill_meta(view, src, dst, same, useg)
    assert meta_entries(useg) == 6
    assert view[:7].tolist() == [10, 20, 30, 1, 2, 3, -1]


def warp_search(start: np.ndarray, n: int, c0: int) -> int:
    """The kernel's 32-lane search, lane by lane (``segment_copy``'s ``warp_search``)."""
    lo, hi = 0, n
    while hi - lo > 32:
        step = (hi - lo + 31) // 32
        m = sum(1 for lane in range(32) if lo + lane * step < hi and start[lo + lane * step] <= c0)
        lo += (m - 1) * step
        hi = min(lo + step, hi)
    return lo + sum(1 for lane in range(32) if lo + lane < hi and start[lo + lane] <= c0) - 1


def check_items(sizes: np.ndarray, grid: Grid, rng: np.random.Generator) -> None:
    """The kernel's item loop copies every byte once: items tile the byte stream, and the segment it
    starts each item in (division or ``warp_search``) holds the item's first byte."""
    seg = describe(sizes)
    starts = np.arange(grid.num_chunks, dtype=np.int64) * grid.chunk_bytes
    ends = np.minimum(starts + grid.chunk_bytes, seg.total_bytes)
    assert starts[0] == 0 and ends[-1] == seg.total_bytes and np.all(ends[:-1] == starts[1:])
    assert np.all(ends > starts)
    prefix = np.concatenate([[0], np.cumsum(sizes)])
    want = np.searchsorted(prefix, starts, side="right") - 1  # the segment holding each first byte
    sample = rng.choice(grid.num_chunks, min(grid.num_chunks, 64), replace=False)
    for c in sample.tolist():
        c0 = int(starts[c])
        k = c0 // seg.uniform_bytes if seg.uniform_bytes else warp_search(prefix, seg.num_segments, c0)
        assert k == want[c], f"item {c} at byte {c0}: segment {k}, expected {want[c]}"


@pytest.mark.parametrize("seed", range(6))
def test_every_byte_is_copied_once_for_any_grid(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 70000))  # up to a 16k-token layer-major prompt's 65,536 segments
    page = int(rng.choice([16, 256, 512]))  # small pages keep the item count small
    kinds = [
        rng.integers(1, 600, n),  # mixed, unaligned
        np.full(n, page),  # uniform
        rng.integers(1, 9, n) * page,  # coalesced runs of pages
    ]
    for sizes in (np.asarray(k, np.int64) for k in kinds):
        seg = describe(sizes)
        for capacity, chunk, max_ctas in ((528, 64 * KiB, 0), (132, 0, 0), (528, 4 * KiB, 16), (7, 300, 0)):
            grid = launch_grid(seg, capacity, chunk, max_ctas)
            assert grid.chunk_bytes % 16 == 0 and grid.chunk_bytes > 0
            assert 1 <= grid.ctas <= min(capacity, max_ctas or capacity, grid.num_chunks)
            check_items(sizes, grid, rng)


def test_grid_never_exceeds_one_wave_and_items_hold_whole_pages() -> None:
    pages = describe(np.full(512, 32 * KiB, np.int64))  # a 128-token prompt, layer-major
    grid = launch_grid(pages, 528, 64 * KiB)
    assert grid == Grid(ctas=512, chunk_bytes=32 * KiB, num_chunks=512)
    big = describe(np.array([2 << 30], np.int64))
    grid = launch_grid(big, 528, 64 * KiB)
    assert grid.ctas == 528 and grid.chunk_bytes == 64 * KiB
    assert launch_grid(big, 528, 64 * KiB, max_ctas=16).ctas == 16
    even = launch_grid(big, 528, 0)  # static even split: one item per CTA
    assert even.num_chunks == 528 and even.ctas == 528
