"""Paged attention equals dense attention, in both cache layouts and on every path: decodes, fresh
prompts (equal lengths, padded and masked, one call each), chunks that continue a cached prefix,
and mixed batches of all of them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moriio_ray.config import EngineConfig
from moriio_ray.engine import attention_prefill
from moriio_ray.engine.arch import ModelArgs
from moriio_ray.engine.attention import AttnMetadata, attend, paged_decode_attention, write_kv
from moriio_ray.engine.attention_prefill import prefill_attention, split_decodes
from moriio_ray.engine.batch import Batch
from moriio_ray.engine.kv_cache import KVCache
from moriio_ray.engine.runner import ModelRunner
from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.engine.sequence import Sequence

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
        write_kv(k_cache, v_cache, k, v, AttnMetadata(blocks, pos % BLOCK))
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
    meta = AttnMetadata(torch.zeros(0), torch.zeros(0), len(tables), decode_tables=padded, decode_mask=mask)
    out = paged_decode_attention(q, k_cache, v_cache, meta)
    for i in range(len(tables)):
        ref = _dense(q[i : i + 1].double(), keys[i].double(), values[i].double(), causal=False)[0]
        torch.testing.assert_close(out[i].double(), ref, rtol=1e-5, atol=1e-5)
    # the other layers' views were not touched
    assert cache.layers[0][0].abs().sum() == 0 and cache.layers[2][1].abs().sum() == 0


def _stub(dtype: torch.dtype = torch.float32) -> ModelRunner:
    """A runner holding only what ``prepare`` reads."""
    stub = ModelRunner.__new__(ModelRunner)
    stub.device, stub.block_size, stub.dtype, stub.fused = torch.device("cpu"), BLOCK, dtype, False
    return stub


def _seq(start: int, q_len: int, table: list[int]) -> Sequence:
    seq = Sequence("s", [1] * (start + q_len), SamplingParams(), seed=0)
    seq.num_cached, seq.block_table = start, table
    return seq


@pytest.mark.timeout(30)
@pytest.mark.parametrize("lengths", [[5, 5, 5], [1, 4, 8, 5, 13]])
@pytest.mark.parametrize("masked", [True, False])
def test_fresh_prompts_match_dense(lengths: list[int], masked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal lengths (one causal call), mixed lengths padded+masked, and mixed lengths one call each."""
    if not masked:
        monkeypatch.setattr(attention_prefill, "MAX_PREFILL_MASK_ELEMS", 0)
    gen = torch.Generator().manual_seed(2)
    total = sum(lengths)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    seqs = [_seq(0, n, list(range(-(-n // BLOCK)))) for n in lengths]
    _, positions, meta, _ = _stub(torch.float64).prepare(Batch.prefill(seqs))
    assert meta.prefill is not None and not meta.prefill.extend and meta.prefill.fresh is not None
    fresh = meta.prefill.fresh
    assert fresh.uniform == (len(set(lengths)) == 1)
    assert (fresh.mask is not None) == (masked and not fresh.uniform)
    out = prefill_attention(q, k, v, torch.empty(0), torch.empty(0), meta.prefill)  # the cache unread
    start = 0
    for n in lengths:
        ref = _dense(q[start : start + n], k[start : start + n], v[start : start + n], causal=True)
        torch.testing.assert_close(out[start : start + n], ref, rtol=1e-10, atol=1e-10)
        start += n
    assert positions.tolist() == np.concatenate([np.arange(n) for n in lengths]).tolist()


# (start, q_len) per row: two decodes, then chunks continuing a cached prefix and fresh prompts
MIXED = [(6, 1), (13, 1), (4, 7), (9, 1 + 2 * BLOCK), (0, 5), (0, 3)]


ORDERS = {
    "decodes_chunks_fresh": MIXED,
    "fresh_between": [*MIXED[:2], MIXED[4], MIXED[2], MIXED[5], MIXED[3]],
    # a decode row far longer than the others attends alone (split_decodes)
    "long_decode": [(6, 1), (150, 1), (13, 1), (9, 1), (3, 1), *MIXED[2:]],
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("layout", ["layer_major", "block_major"])
@pytest.mark.parametrize("order", list(ORDERS))
def test_mixed_batch_matches_dense(layout: str, order: str) -> None:
    """Decode rows, continued chunks and fresh prompts in one step: each row attends over its own
    cached prefix and new tokens, causally, exactly as dense attention over its whole context."""
    rows = ORDERS[order]
    gen = torch.Generator().manual_seed(5)
    cache = _cache(layout, num_blocks=96)
    k_cache, v_cache = cache.layers[2]
    free = torch.randperm(cache.num_blocks, generator=gen).tolist()
    seqs, history = [], []
    for start, n in rows:
        seq = _seq(start, n, [free.pop() for _ in range(-(-(start + n) // BLOCK))])
        hk, hv = (torch.randn(start, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
        pos = torch.arange(start)
        blocks = torch.tensor(seq.block_table, dtype=torch.int64)[pos // BLOCK]
        write_kv(k_cache, v_cache, hk, hv, AttnMetadata(blocks, pos % BLOCK))  # the cached prefix
        seqs.append(seq)
        history.append((hk, hv))
    num_decodes = sum(1 for _, n in rows if n == 1)
    batch = Batch(seqs, [n for _, n in rows], num_decodes=num_decodes)
    _ids, positions, meta, sample_index = _stub().prepare(batch)
    assert [r.start for r in meta.decode_alone] == ([1] if order == "long_decode" else [])
    total = sum(n for _, n in rows)
    assert positions.tolist() == [p for s, n in rows for p in range(s, s + n)]
    assert sample_index is None or sample_index.numel() == len(rows)  # every row reaches its end
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    write_kv(k_cache, v_cache, k, v, meta)
    out = attend(q, k, v, k_cache, v_cache, meta)
    t = 0
    for (_, n), (hk, hv) in zip(rows, history, strict=True):
        keys, values = torch.cat([hk, k[t : t + n]]), torch.cat([hv, v[t : t + n]])
        ref = _dense(q[t : t + n].double(), keys.double(), values.double(), causal=True)
        torch.testing.assert_close(out[t : t + n].double(), ref, rtol=1e-5, atol=1e-5)
        t += n


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


def test_split_decodes_leaves_alone_only_rows_far_longer_than_the_rest() -> None:
    assert split_decodes([10] * 16) == []
    assert split_decodes([10, 12, 9, 257, 11]) == [3]
    assert split_decodes([10] * 16 + [257, 300]) == [16, 17]
    assert split_decodes([30, 40, 35]) == []
    assert split_decodes([5]) == []
