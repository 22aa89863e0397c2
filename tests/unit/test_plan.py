"""Transfer plans against real tensors: copying the planned bytes equals indexing the caches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moriio_ray.errors import ConfigError
from moriio_ray.transfer.layout import BLOCK_MAJOR, LAYER_MAJOR, KVLayout
from moriio_ray.transfer.plan import TransferPlan, coalesce, plan_blocks

pytestmark = pytest.mark.timeout(30)

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def layout(order: str, num_blocks: int = 12, dtype: str = "float16", **kw: int) -> KVLayout:
    fields = {"num_layers": 3, "block_size": 4, "num_kv_heads": 2, "head_dim": 8, **kw}
    return KVLayout(num_blocks=num_blocks, dtype=dtype, order=order, **fields)


def cache(lay: KVLayout, seed: int) -> torch.Tensor:
    """A cache tensor of the layout's shape with distinct values."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(lay.shape, generator=gen).to(TORCH_DTYPES[lay.dtype])


def apply(plan: TransferPlan, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the planned bytes from ``src`` (remote) into ``dst`` (local), as an agent would."""
    d, s = dst.view(-1).view(torch.uint8), src.view(-1).view(torch.uint8)
    for lo, ro, n in zip(
        plan.local_offsets.tolist(), plan.remote_offsets.tolist(), plan.sizes.tolist(), strict=True
    ):
        d[lo : lo + n] = s[ro : ro + n]


def block(t: torch.Tensor, lay: KVLayout, layer: int, kv: int, blk: int) -> torch.Tensor:
    """One (layer, K/V, block) segment by indexing the tensor, whatever its order."""
    return t[layer, kv, blk] if lay.order == LAYER_MAJOR else t[blk, layer, kv]


ORDERS = [
    (LAYER_MAJOR, LAYER_MAJOR),
    (BLOCK_MAJOR, BLOCK_MAJOR),
    (LAYER_MAJOR, BLOCK_MAJOR),
    (BLOCK_MAJOR, LAYER_MAJOR),
]


@pytest.mark.parametrize(("local_order", "remote_order"), ORDERS)
@pytest.mark.parametrize("layers", [None, range(1, 3)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_planned_bytes_equal_tensor_indexing(
    local_order: str, remote_order: str, layers: range | None, dtype: str
) -> None:
    local_l, remote_l = layout(local_order, 12, dtype), layout(remote_order, 20, dtype)
    local_t, remote_t = torch.zeros(local_l.shape, dtype=TORCH_DTYPES[dtype]), cache(remote_l, 1)
    lb = np.array([5, 6, 7, 0, 11, 2])  # a contiguous run and strays
    rb = np.array([3, 4, 5, 19, 0, 8])
    plan = plan_blocks(lb, rb, local_l, remote_l, layers)
    apply(plan, local_t, remote_t)
    moved = range(3) if layers is None else layers
    expect = torch.zeros_like(local_t)
    for layer in moved:
        for kv in range(2):
            for i, j in zip(lb.tolist(), rb.tolist(), strict=True):
                block(expect, local_l, layer, kv, i).copy_(block(remote_t, remote_l, layer, kv, j))
    assert torch.equal(local_t.view(torch.uint8), expect.view(torch.uint8))
    assert plan.num_bytes == len(moved) * 2 * lb.size * local_l.segment_bytes


def test_layer_major_coalesces_runs_per_layer_and_kv() -> None:
    lay = layout(LAYER_MAJOR)
    plan = plan_blocks([3, 4, 5], [7, 8, 9], lay, lay)
    assert plan.num_segments == 3 * 2  # one run of 3 blocks per (layer, K/V)
    assert set(plan.sizes.tolist()) == {3 * lay.segment_bytes}
    broken = plan_blocks([3, 4, 5], [7, 9, 8], lay, lay)  # the remote run is broken after block 7
    assert broken.num_segments == 3 * 2 * 3  # no remote run: one segment per block, layer and K/V
    assert broken.num_bytes == plan.num_bytes


def test_block_major_makes_one_segment_per_contiguous_run() -> None:
    lay = layout(BLOCK_MAJOR)
    assert plan_blocks([3, 4, 5], [7, 8, 9], lay, lay).num_segments == 1
    assert plan_blocks([3, 4, 5], [7, 9, 8], lay, lay).num_segments == 3  # no run on the remote side
    one = plan_blocks([2], [6], lay, lay)
    assert one.sizes.tolist() == [lay.block_bytes]
    assert one.local_offsets.tolist() == [2 * lay.block_bytes]
    # a layer range inside a block-major cache is one segment per block (layers are inside it)
    part = plan_blocks([3, 4], [7, 8], lay, lay, range(1, 2))
    assert part.num_segments == 2 * 1  # K and V of layer 1 are contiguous, but blocks are not
    assert part.sizes.tolist() == [2 * lay.segment_bytes] * 2


def test_coalesce_merges_only_runs_contiguous_on_both_sides() -> None:
    lo = np.array([0, 10, 20, 50, 60], dtype=np.int64)
    ro = np.array([100, 110, 200, 210, 220], dtype=np.int64)
    sz = np.full(5, 10, dtype=np.int64)
    plan = coalesce(lo, ro, sz)
    # 0+10 run on both; 20 breaks remote; 50 breaks local; 60 follows 50 on both
    assert plan.local_offsets.tolist() == [0, 20, 50]
    assert plan.remote_offsets.tolist() == [100, 200, 210]
    assert plan.sizes.tolist() == [20, 10, 20]
    single = coalesce(lo[:1], ro[:1], sz[:1])
    assert single.num_segments == 1 and single.num_bytes == 10


@pytest.mark.parametrize("field", ["num_layers", "block_size", "num_kv_heads", "head_dim", "dtype"])
def test_layout_mismatch_names_the_field(field: str) -> None:
    local = layout(LAYER_MAJOR)
    other = {"dtype": "float32"} if field == "dtype" else {field: getattr(local, field) + 1}
    remote = KVLayout(**{**{f: getattr(local, f) for f in local.__struct_fields__}, **other})
    with pytest.raises(ConfigError, match=rf"^layout\.{field}: local .* differs from remote"):
        plan_blocks([0], [0], local, remote)


def test_block_and_layer_errors() -> None:
    lay = layout(LAYER_MAJOR)
    with pytest.raises(ConfigError, match="block ids: 2 local blocks but 1 remote blocks"):
        plan_blocks([0, 1], [0], lay, lay)
    with pytest.raises(ConfigError, match=r"remote block ids: block id 12 is outside 0\.\.11"):
        plan_blocks([0], [12], lay, lay)
    with pytest.raises(ConfigError, match="local block ids: block id -1 is outside"):
        plan_blocks([-1], [0], lay, lay)
    for bad in (range(0, 3, 2), range(2, 2), range(1, 4)):
        with pytest.raises(ConfigError, match=r"layers: .* is not a non-empty range inside 0\.\.3"):
            plan_blocks([0], [0], lay, lay, bad)


def test_layout_checks_its_fields() -> None:
    with pytest.raises(ConfigError, match="order: 'head_major' is not one of layer_major, block_major"):
        layout("head_major")
    with pytest.raises(ConfigError, match="dtype: 'int4' is not one of"):
        layout(LAYER_MAJOR, dtype="int4")
    with pytest.raises(ConfigError, match="head_dim: 0 must be >= 1"):
        layout(LAYER_MAJOR, head_dim=0)
    lay = layout(BLOCK_MAJOR, 12, "bfloat16")
    assert lay.total_bytes == cache(lay, 0).numel() * 2
