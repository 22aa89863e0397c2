"""Transfer plans: block ids on both sides -> one batch of coalesced (offset, offset, size) segments.

``TransferPlan`` is the one segment type of the agent API (``agent.read(local_mem, remote_mem,
plan)``): it is validated when it is built, and a backend checks its bounds once per side.

Between tensor-parallel engines each cache holds a range of the model's KV heads (``KVLayout.heads``).
A plan moves the heads both caches hold (their intersection): with equal ranges (P and D of one TP
size, rank for rank) that is whole segments, coalesced into runs; otherwise, inside each block
(``[block_size][heads][head_dim]``), one token's sub-range of heads is one segment. ``rank_pairs``
says which (local rank, remote rank) pairs share heads: one plan, and one batched transfer, each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np

from moriio_ray.errors import ConfigError, SegmentOutOfBounds
from moriio_ray.transfer.desc import EngineDesc, MemoryDesc
from moriio_ray.transfer.layout import LAYER_MAJOR, KVLayout

_MUST_MATCH = ("num_layers", "block_size", "head_dim", "dtype")
_FIELDS = ("local_offsets", "remote_offsets", "sizes")


class Copy(NamedTuple):
    """A plan in the direction its bytes move: ``dst[dst_offsets[i]:+sizes[i]] <- src[src_offsets[i]:]``."""

    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    sizes: np.ndarray


class TransferPlan(msgspec.Struct, frozen=True):
    """Segments in bytes: ``local[local_offsets[i]:+sizes[i]]`` <-> ``remote[remote_offsets[i]:...]``.

    Built from any integer array-likes; on construction they become contiguous 1-D int64 arrays of
    one length (ConfigError otherwise), so that nothing downstream validates them again.
    """

    local_offsets: np.ndarray  # [n] int64
    remote_offsets: np.ndarray  # [n] int64
    sizes: np.ndarray  # [n] int64

    def __post_init__(self) -> None:
        arrays = [_int64_array(name, getattr(self, name)) for name in _FIELDS]
        if len({a.size for a in arrays}) > 1:
            raise ConfigError(
                "sizes: local_offsets, remote_offsets and sizes differ in length "
                f"({', '.join(str(a.size) for a in arrays)})"
            )
        for name, arr in zip(_FIELDS, arrays, strict=True):
            msgspec.structs.force_setattr(self, name, arr)

    @property
    def num_segments(self) -> int:
        return int(self.sizes.size)

    @property
    def num_bytes(self) -> int:
        return int(self.sizes.sum())

    def check_local(self, region_bytes: int, what: str) -> None:
        check_bounds(self.local_offsets, self.sizes, region_bytes, "local", what)

    def check_remote(self, region_bytes: int, what: str) -> None:
        check_bounds(self.remote_offsets, self.sizes, region_bytes, "remote", what)

    def shifted(self, local_bytes: int, remote_bytes: int) -> TransferPlan:
        """The same segments moved by ``local_bytes`` here and ``remote_bytes`` there."""
        return TransferPlan(self.local_offsets + local_bytes, self.remote_offsets + remote_bytes, self.sizes)

    def copy_for(self, op: str) -> Copy:
        """The copy ``op`` makes: a read moves remote bytes into local memory, a write the reverse."""
        if op == "read":
            return Copy(self.remote_offsets, self.local_offsets, self.sizes)
        return Copy(self.local_offsets, self.remote_offsets, self.sizes)


class PullItem(msgspec.Struct, frozen=True):
    """One batched read: from the remote rank ``peer``'s region into the local rank's cache."""

    peer: EngineDesc
    remote_mem: MemoryDesc
    plan: TransferPlan


def _int64_array(name: str, value: Any) -> np.ndarray:
    arr = np.ascontiguousarray(np.asarray(value))
    if arr.ndim != 1:
        raise ConfigError(f"{name}: expected a 1-D array, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ConfigError(f"{name}: expected integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def check_bounds(offsets: np.ndarray, sizes: np.ndarray, region_bytes: int, side: str, what: str) -> None:
    """Raise SegmentOutOfBounds naming the first segment outside ``[0, region_bytes)``."""
    if offsets.size == 0:
        return
    # four reductions on the hot path; the mask below only runs to name a bad segment
    if offsets.min() >= 0 and sizes.min() > 0 and int((offsets + sizes).max()) <= region_bytes:
        return
    bad = (offsets < 0) | (sizes <= 0) | (offsets + sizes > region_bytes)
    if bad.any():
        i = int(np.argmax(bad))
        raise SegmentOutOfBounds(
            f"segment {i}: {side} offset {int(offsets[i])} + size {int(sizes[i])} is outside "
            f"{what} ({region_bytes} bytes)"
        )


def batches(sizes: np.ndarray, max_segments: int, max_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) segment ranges of at most ``max_segments`` segments and about ``max_bytes`` each."""
    out = []
    start, n = 0, int(sizes.size)
    ends = np.cumsum(sizes)
    while start < n:
        base = int(ends[start - 1]) if start else 0
        # the first segment whose end reaches base + max_bytes closes the range
        stop = int(np.searchsorted(ends, base + max_bytes, side="left")) + 1
        stop = min(max(stop, start + 1), start + max_segments, n)
        out.append((start, stop))
        start = stop
    return out


def check_compatible(local: KVLayout, remote: KVLayout) -> None:
    """Raise ConfigError naming the first field that differs between two caches."""
    for name in _MUST_MATCH:
        a, b = getattr(local, name), getattr(remote, name)
        if a != b:
            raise ConfigError(f"layout.{name}: local {a!r} differs from remote {b!r}; the engines must agree")
    if local.model_kv_heads != remote.model_kv_heads:
        name = "total_kv_heads" if local.total_kv_heads or remote.total_kv_heads else "num_kv_heads"
        raise ConfigError(
            f"layout.{name}: local {local.model_kv_heads!r} differs from remote {remote.model_kv_heads!r}; "
            "the engines must agree"
        )


def shared_heads(local: KVLayout, remote: KVLayout) -> range:
    """The model's KV heads that both caches hold (empty if none)."""
    a, b = local.heads, remote.heads
    start = max(a.start, b.start)
    return range(start, max(start, min(a.stop, b.stop)))


def rank_pairs(local_ranks: Sequence[KVLayout], remote_ranks: Sequence[KVLayout]) -> list[tuple[int, int]]:
    """Every (local rank, remote rank) whose caches share KV heads, local rank first.

    Between P with TP = p and D with TP = d, each D rank pairs with the P ranks that hold its heads:
    with p == d that is rank r with rank r only.
    """
    return [
        (i, j)
        for i, lay in enumerate(local_ranks)
        for j, rem in enumerate(remote_ranks)
        if len(shared_heads(lay, rem)) > 0
    ]


def coalesce(lo: np.ndarray, ro: np.ndarray, sz: np.ndarray) -> TransferPlan:
    """Merge neighbouring segments that are contiguous on both sides (order is kept)."""
    if sz.size <= 1:
        return TransferPlan(lo, ro, sz)
    ends_l = lo[:-1] + sz[:-1]
    ends_r = ro[:-1] + sz[:-1]
    starts = np.empty(sz.size, dtype=bool)
    starts[0] = True
    starts[1:] = (lo[1:] != ends_l) | (ro[1:] != ends_r)
    idx = np.flatnonzero(starts)
    return TransferPlan(lo[idx], ro[idx], np.add.reduceat(sz, idx))


def plan_blocks(
    local_blocks: Sequence[int] | np.ndarray,
    remote_blocks: Sequence[int] | np.ndarray,
    local: KVLayout,
    remote: KVLayout,
    layers: range | None = None,
) -> TransferPlan:
    """Segments moving ``remote_blocks[i]`` <-> ``local_blocks[i]`` for the given layers (all by
    default), for the KV heads both caches hold; ConfigError if they share none."""
    check_compatible(local, remote)
    lb = np.asarray(local_blocks, dtype=np.int64).reshape(-1)
    rb = np.asarray(remote_blocks, dtype=np.int64).reshape(-1)
    if lb.size != rb.size:
        raise ConfigError(f"block ids: {lb.size} local blocks but {rb.size} remote blocks")
    local.check_blocks(lb, "local block ids")
    remote.check_blocks(rb, "remote block ids")
    layers = range(local.num_layers) if layers is None else layers
    if layers.step != 1 or layers.start < 0 or layers.stop > local.num_layers or len(layers) == 0:
        raise ConfigError(f"layers: {layers} is not a non-empty range inside 0..{local.num_layers}")
    ly = np.arange(layers.start, layers.stop, dtype=np.int64)
    kv = np.arange(2, dtype=np.int64)
    # Enumerate in the order that is contiguous in the local cache, so that coalescing finds runs.
    if local.order == LAYER_MAJOR:
        L, K, B = np.meshgrid(ly, kv, np.arange(lb.size), indexing="ij")  # [layers, 2, n]
    else:
        B, L, K = np.meshgrid(np.arange(lb.size), ly, kv, indexing="ij")  # [n, layers, 2]
    lyr, kvs, idx = L.reshape(-1), K.reshape(-1), B.reshape(-1)
    lo = local.segment_offsets(lyr, kvs, lb[idx])
    ro = remote.segment_offsets(lyr, kvs, rb[idx])
    if local.heads == remote.heads:  # the same heads: whole segments, coalesced into runs
        sz = np.full(lo.size, local.segment_bytes, dtype=np.int64)
        return coalesce(lo, ro, sz)
    heads = shared_heads(local, remote)
    if not heads:
        raise ConfigError(
            f"layout.kv_head_start: local heads {_span(local.heads)} and remote heads "
            f"{_span(remote.heads)} share none; pair only ranks that hold common heads (rank_pairs)"
        )
    return coalesce(*_head_slices(lo, ro, local, remote, heads))


def _head_slices(
    lo: np.ndarray, ro: np.ndarray, local: KVLayout, remote: KVLayout, heads: range
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per segment [block_size][heads][dim]: one (local, remote, size) per token for ``heads``."""
    hb = local.head_bytes
    token = np.arange(local.block_size, dtype=np.int64)  # [bs]
    local_rows = (token * local.num_kv_heads + heads.start - local.kv_head_start) * hb
    remote_rows = (token * remote.num_kv_heads + heads.start - remote.kv_head_start) * hb
    l_off = (lo[:, None] + local_rows[None, :]).reshape(-1)  # [segments * bs], local order kept
    r_off = (ro[:, None] + remote_rows[None, :]).reshape(-1)
    return l_off, r_off, np.full(l_off.size, len(heads) * hb, dtype=np.int64)


def _span(heads: range) -> str:
    return f"{heads.start}..{heads.stop - 1}"
