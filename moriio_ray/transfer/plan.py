"""Transfer plans: block ids on both sides -> one batch of coalesced (offset, offset, size) segments."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from moriio_ray.errors import ConfigError
from moriio_ray.transfer.layout import LAYER_MAJOR, KVLayout

_MUST_MATCH = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype")


class TransferPlan(msgspec.Struct, frozen=True):
    """Coalesced segments, in bytes, ready for ``agent.read``/``agent.write``."""

    local_offsets: np.ndarray  # [n] int64
    remote_offsets: np.ndarray  # [n] int64
    sizes: np.ndarray  # [n] int64

    @property
    def num_segments(self) -> int:
        return int(self.sizes.size)

    @property
    def num_bytes(self) -> int:
        return int(self.sizes.sum())


def check_compatible(local: KVLayout, remote: KVLayout) -> None:
    """Raise ConfigError naming the first field that differs between two caches."""
    for name in _MUST_MATCH:
        a, b = getattr(local, name), getattr(remote, name)
        if a != b:
            raise ConfigError(f"layout.{name}: local {a!r} differs from remote {b!r}; the engines must agree")


def coalesce(lo: np.ndarray, ro: np.ndarray, sz: np.ndarray) -> TransferPlan:
    """Merge neighbouring segments that are contiguous on both sides (order is kept)."""
    if sz.size <= 1:
        return TransferPlan(lo.astype(np.int64), ro.astype(np.int64), sz.astype(np.int64))
    ends_l = lo[:-1] + sz[:-1]
    ends_r = ro[:-1] + sz[:-1]
    starts = np.empty(sz.size, dtype=bool)
    starts[0] = True
    starts[1:] = (lo[1:] != ends_l) | (ro[1:] != ends_r)
    idx = np.flatnonzero(starts)
    return TransferPlan(lo[idx].copy(), ro[idx].copy(), np.add.reduceat(sz, idx).astype(np.int64))


def plan_blocks(
    local_blocks: Sequence[int] | np.ndarray,
    remote_blocks: Sequence[int] | np.ndarray,
    local: KVLayout,
    remote: KVLayout,
    layers: range | None = None,
) -> TransferPlan:
    """Segments moving ``remote_blocks[i]`` <-> ``local_blocks[i]`` for the given layers (all by default)."""
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
    sz = np.full(lo.size, local.segment_bytes, dtype=np.int64)
    return coalesce(lo, ro, sz)
