"""Head-sliced plans between tensor-parallel caches, against a numpy reference.

P runs with TP = p and D with TP = d over a model with 12 KV heads (so every size up to 4 divides
it). Each D rank pulls, from every P rank that shares heads with it, one plan; applied byte by
byte, the plans must write every byte of the D rank's own heads in the destination blocks exactly
once, with P's values, and touch nothing else.
"""

from __future__ import annotations

import numpy as np
import pytest

from moriio_ray.engine.tp_size import shard_range
from moriio_ray.errors import ConfigError
from moriio_ray.transfer.layout import BLOCK_MAJOR, LAYER_MAJOR, KVLayout
from moriio_ray.transfer.plan import TransferPlan, plan_blocks, rank_pairs, shared_heads

pytestmark = pytest.mark.timeout(60)

HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 12, 4, 4, 2
P_BLOCKS, D_BLOCKS = 20, 16
ORDERS = [
    (LAYER_MAJOR, LAYER_MAJOR),
    (BLOCK_MAJOR, BLOCK_MAJOR),
    (LAYER_MAJOR, BLOCK_MAJOR),
    (BLOCK_MAJOR, LAYER_MAJOR),
]


def rank_layouts(tp: int, num_blocks: int, order: str) -> list[KVLayout]:
    """The caches of ranks 0..tp-1 (float16: two bytes per element, so offsets are in bytes)."""
    out = []
    for rank in range(tp):
        heads = shard_range(HEADS, rank, tp)
        out.append(
            KVLayout(
                num_layers=LAYERS,
                num_blocks=num_blocks,
                block_size=BLOCK_SIZE,
                num_kv_heads=len(heads),
                head_dim=HEAD_DIM,
                dtype="float16",
                order=order,
                kv_head_start=heads.start,
                total_kv_heads=HEADS,
            )
        )
    return out


def rank_cache(full: np.ndarray, lay: KVLayout) -> np.ndarray:
    """A rank's cache holding its heads of ``full`` [layers, 2, blocks, bs, H, dim], in its order."""
    part = full[:, :, :, :, lay.heads.start : lay.heads.stop, :]
    if lay.order == BLOCK_MAJOR:
        part = part.transpose(2, 0, 1, 3, 4, 5)  # [blocks, layers, 2, bs, h, dim]
    return np.ascontiguousarray(part)


def canonical(cache: np.ndarray, lay: KVLayout) -> np.ndarray:
    """A rank's cache as [layers, 2, blocks, bs, h, dim], whatever its order."""
    return cache.transpose(1, 2, 0, 3, 4, 5) if lay.order == BLOCK_MAJOR else cache


def apply(plan: TransferPlan, dst: np.ndarray, src: np.ndarray, writes: np.ndarray) -> None:
    """Copy the planned bytes src (remote) -> dst (local) and count the writes of each dst byte."""
    d, s = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
    for lo, ro, n in zip(
        plan.local_offsets.tolist(), plan.remote_offsets.tolist(), plan.sizes.tolist(), strict=True
    ):
        d[lo : lo + n] = s[ro : ro + n]
        writes[lo : lo + n] += 1


@pytest.mark.parametrize(("p_order", "d_order"), ORDERS)
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("d", [1, 2, 3, 4])
def test_every_byte_of_the_right_heads_moves_exactly_once(p: int, d: int, p_order: str, d_order: str) -> None:
    rng = np.random.default_rng(p * 10 + d)
    full = rng.integers(1, 30000, size=(LAYERS, 2, P_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM), dtype=np.int16)
    p_lays, d_lays = rank_layouts(p, P_BLOCKS, p_order), rank_layouts(d, D_BLOCKS, d_order)
    p_caches = [rank_cache(full, lay) for lay in p_lays]
    n = int(rng.integers(1, 9))
    p_blocks = rng.choice(P_BLOCKS, size=n, replace=False)
    d_blocks = rng.choice(D_BLOCKS, size=n, replace=False)

    pairs = rank_pairs(d_lays, p_lays)
    for j, d_lay in enumerate(d_lays):  # each D rank pairs with exactly the P ranks holding its heads
        holders = {i for i, p_lay in enumerate(p_lays) if set(p_lay.heads) & set(d_lay.heads)}
        assert {i for jj, i in pairs if jj == j} == holders
    for j, d_lay in enumerate(d_lays):
        dst = np.zeros(d_lay.shape, dtype=np.int16)
        writes = np.zeros(dst.nbytes, dtype=np.int64)
        for jj, i in pairs:
            if jj == j:
                plan = plan_blocks(d_blocks, p_blocks, d_lay, p_lays[i])
                apply(plan, dst, p_caches[i], writes)
        # exactly once inside the destination blocks, never outside them
        per_byte = canonical(writes.reshape(*d_lay.shape[:-1], HEAD_DIM * 2), d_lay)  # [.., h, bytes]
        inside = np.zeros(D_BLOCKS, dtype=bool)
        inside[d_blocks] = True
        assert (per_byte[:, :, inside] == 1).all()
        assert (per_byte[:, :, ~inside] == 0).all()
        got = canonical(dst, d_lay)[:, :, d_blocks]
        want = full[:, :, p_blocks][:, :, :, :, d_lay.heads.start : d_lay.heads.stop]
        assert np.array_equal(got, want)


@pytest.mark.parametrize("order", [LAYER_MAJOR, BLOCK_MAJOR])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_equal_tp_keeps_the_same_layout_fast_path(order: str, tp: int) -> None:
    """p == d: rank r pairs with rank r only, and its plan is the whole-segment runs of size 1."""
    p_lays, d_lays = rank_layouts(tp, P_BLOCKS, order), rank_layouts(tp, D_BLOCKS, order)
    assert rank_pairs(d_lays, p_lays) == [(r, r) for r in range(tp)]
    whole = rank_layouts(1, P_BLOCKS, order)[0], rank_layouts(1, D_BLOCKS, order)[0]
    blocks = ([3, 4, 5, 9], [7, 8, 9, 1])
    one = plan_blocks(*blocks, whole[1], whole[0])
    for r in range(tp):
        plan = plan_blocks(*blocks, d_lays[r], p_lays[r])
        assert plan.num_segments == one.num_segments  # one segment run per block (and layer, K/V)
        assert plan.num_bytes * tp == one.num_bytes


def test_head_slices_are_one_segment_per_token_and_runs_where_both_sides_are_contiguous() -> None:
    (p_lay,) = rank_layouts(1, P_BLOCKS, LAYER_MAJOR)
    d_lays = rank_layouts(2, D_BLOCKS, LAYER_MAJOR)
    plan = plan_blocks([0, 1], [5, 6], d_lays[1], p_lay)
    # D rank 1 takes heads 6..11 of every token: contiguous on D, strided on P
    assert plan.num_segments == LAYERS * 2 * 2 * BLOCK_SIZE
    assert set(plan.sizes.tolist()) == {6 * HEAD_DIM * 2}
    assert shared_heads(d_lays[1], p_lay) == range(6, 12)


def test_layouts_of_other_models_or_disjoint_heads_are_refused() -> None:
    (a,) = rank_layouts(1, P_BLOCKS, LAYER_MAJOR)
    other = KVLayout(
        num_layers=LAYERS, num_blocks=8, block_size=BLOCK_SIZE, num_kv_heads=6, head_dim=HEAD_DIM,
        dtype="float16", total_kv_heads=8,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"^layout\.total_kv_heads: local 12 differs from remote 8"):
        plan_blocks([0], [0], a, other)
    d_lays = rank_layouts(2, D_BLOCKS, LAYER_MAJOR)
    with pytest.raises(
        ConfigError, match=r"layout\.kv_head_start: local heads 0\.\.5 and remote heads 6\.\.11"
    ):
        plan_blocks([0], [0], d_lays[0], d_lays[1])
    with pytest.raises(ConfigError, match=r"kv_head_start: heads 10\.\.15 do not fit"):
        KVLayout(
            num_layers=1, num_blocks=1, block_size=1, num_kv_heads=6, head_dim=1, kv_head_start=10,
            total_kv_heads=12,
        )  # fmt: skip
