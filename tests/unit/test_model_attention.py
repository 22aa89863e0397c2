"""Paged attention equals dense attention, in both cache layouts and on every prefill path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moriio_ray.config import EngineConfig
from moriio_ray.engine import runner as runner_mod
from moriio_ray.engine.arch import ModelArgs
from moriio_ray.engine.attention import AttnMetadata, paged_decode_attention, prefill_attention, write_kv
from moriio_ray.engine.kv_cache import KVCache

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 8, 4


def _cache(layout: str, num_blocks: int = 32) -> KVCache:
    args = ModelArgs(
        model_type="llama", vocab_size=8, hidden_size=HEADS * HEAD_DIM, intermediate_size=8, num_layers=3,
        num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=256,
    )  # fmt: skip
    config = EngineConfig(device="cpu", block_size=BLOCK, num_blocks=num_blocks, layout=layout)
    return KVCache(args, config, torch.float32, torch.device("cpu"))


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Reference: q [Lq, H, D] over k/v [Lk, Hkv, D], float64, explicit softmax, GQA by repetition."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        keep = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("layout", ["layer_major", "block_major"])
def test_paged_decode_matches_dense(layout: str) -> None:
    gen = torch.Generator().manual_seed(1)
    cache = _cache(layout)
    k_cache, v_cache = cache.layers[1]
    context_lens = [1, BLOCK, 2 * BLOCK, BLOCK + 1, 11]
    free = torch.randperm(cache.num_blocks, generator=gen).tolist()  # scattered, out-of-order blocks
    tables, keys, values = [], [], []
    for n in context_lens:
        table = [free.pop() for _ in range(-(-n // BLOCK))]
        k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen)
        pos = torch.arange(n)
        blocks = torch.tensor(table)[pos // BLOCK]
        write_kv(k_cache, v_cache, k, v, AttnMetadata(False, blocks, pos % BLOCK))
        tables.append(table)
        keys.append(k)
        values.append(v)
    max_blocks = max(len(t) for t in tables)
    padded = torch.zeros(len(tables), max_blocks, dtype=torch.int64)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = torch.tensor(t)
    span = torch.arange(max_blocks * BLOCK)
    mask = (span[None, :] < torch.tensor(context_lens)[:, None])[:, None, None, :]
    q = torch.randn(len(tables), HEADS, HEAD_DIM, generator=gen)
    meta = AttnMetadata(False, torch.zeros(0), torch.zeros(0), block_tables=padded, decode_mask=mask)
    out = paged_decode_attention(q, k_cache, v_cache, meta)
    for i in range(len(tables)):
        ref = _dense(q[i : i + 1].double(), keys[i].double(), values[i].double(), causal=False)[0]
        torch.testing.assert_close(out[i].double(), ref, rtol=1e-5, atol=1e-5)
    # the other layers' views were not touched
    assert cache.layers[0][0].abs().sum() == 0 and cache.layers[2][1].abs().sum() == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("lengths", [[5, 5, 5], [1, 4, 8, 5, 13]])
@pytest.mark.parametrize("masked", [True, False])
def test_prefill_matches_dense(lengths: list[int], masked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal lengths (one causal call), mixed lengths padded+masked, and mixed lengths one call each."""
    if not masked:
        monkeypatch.setattr(runner_mod, "MAX_PREFILL_MASK_ELEMS", 0)
    gen = torch.Generator().manual_seed(2)
    total = sum(lengths)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    # build the metadata exactly as the runner does (through a stub holding only what it reads)
    stub = runner_mod.ModelRunner.__new__(runner_mod.ModelRunner)
    stub.device, stub.block_size = torch.device("cpu"), BLOCK

    class _Seq:
        def __init__(self, n: int) -> None:
            self.num_tokens, self.block_table = n, list(range(-(-n // BLOCK)))

        def token_ids(self) -> list[int]:
            return [0] * self.num_tokens

    _, positions, meta = stub.prepare_prefill([_Seq(n) for n in lengths])  # type: ignore[list-item]
    assert meta.uniform == (len(set(lengths)) == 1)
    assert (meta.prefill_mask is not None) == (masked and not meta.uniform)
    out = prefill_attention(q, k, v, meta)
    start = 0
    for n in lengths:
        ref = _dense(q[start : start + n], k[start : start + n], v[start : start + n], causal=True)
        torch.testing.assert_close(out[start : start + n], ref, rtol=1e-10, atol=1e-10)
        start += n
    assert positions.tolist() == np.concatenate([np.arange(n) for n in lengths]).tolist()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("layout", ["layer_major", "block_major"])
def test_cache_views_sit_where_the_layout_says(layout: str) -> None:
    """Each (layer, K/V, block) view lands at the byte offset KVLayout (and so plan_blocks) computes."""
    cache = _cache(layout, num_blocks=5)
    lay = cache.layout
    for layer, (k_cache, v_cache) in enumerate(cache.layers):
        for kv, view in enumerate((k_cache, v_cache)):
            for block in range(lay.num_blocks):
                view[block] = float(1000 * layer + 100 * kv + block)
    raw = cache.tensor.view(-1).view(torch.uint8)
    for layer in range(lay.num_layers):
        for kv in range(2):
            for block in range(lay.num_blocks):
                offset = int(lay.segment_offsets(np.array(layer), np.array(kv), np.array(block)))
                segment = raw[offset : offset + lay.segment_bytes].view(torch.float32)
                assert torch.all(segment == 1000 * layer + 100 * kv + block)
    assert lay.total_bytes == cache.tensor.numel() * cache.tensor.element_size()
