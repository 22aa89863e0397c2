"""Prefill on one engine, a block copy planned by plan_blocks, decode on another: exactly the
colocated tokens, greedy and with seeded temperature sampling, in both layouts and across them."""

from __future__ import annotations

import itertools

import pytest
import torch
from engine_helpers import (
    BLOCK_SIZE,
    disaggregated,
    prompts_for_block_size,
    run_to_end,
    tiny_engine,
    with_first,
)

from moriio_ray.engine.batch import PrefillChunk
from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.errors import InvalidRequest


def _colocated(prompts: list[list[int]], params: list[SamplingParams], layout: str = "layer_major"):
    engine = tiny_engine(layout=layout)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    return run_to_end(engine)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("p_layout", "d_layout"),
    [("layer_major", "layer_major"), ("block_major", "block_major"), ("layer_major", "block_major")],
)
def test_pd_greedy_equals_colocated(p_layout: str, d_layout: str) -> None:
    prompts = prompts_for_block_size(BLOCK_SIZE, count=20)
    assert {1, BLOCK_SIZE, 2 * BLOCK_SIZE, BLOCK_SIZE + 1} <= {len(p) for p in prompts}
    params = [SamplingParams(max_tokens=10, ignore_eos=True, logprobs=True)] * len(prompts)
    prefill, decode = tiny_engine("prefill", layout=p_layout), tiny_engine("decode", layout=d_layout)
    start_p, start_d = prefill.stats(), decode.stats()
    got = disaggregated(prefill, decode, prompts, params)
    want = _colocated(prompts, params)
    assert set(got) == set(want) and len(want) == 20
    for rid in want:
        assert got[rid].tokens == want[rid].tokens, rid
        assert got[rid].finish_reason == want[rid].finish_reason == "length"
        assert len(got[rid].logprobs) == 10
        torch.testing.assert_close(got[rid].logprobs, want[rid].logprobs, atol=1e-4, rtol=0)
    assert prefill.stats() == start_p and decode.stats() == start_d


@pytest.mark.timeout(60)
def test_pd_seeded_temperature_equals_colocated() -> None:
    prompts = prompts_for_block_size(BLOCK_SIZE, count=20, seed=1)
    params = [
        SamplingParams(max_tokens=12, temperature=t, top_k=k, top_p=p, seed=100 + i, ignore_eos=True)
        for i, (t, k, p) in enumerate([(1.5, -1, 1.0), (2.0, 20, 1.0), (3.0, -1, 0.9), (2.5, 50, 0.95)] * 5)
    ]
    got = disaggregated(tiny_engine("prefill"), tiny_engine("decode"), prompts, params)
    want = _colocated(prompts, params)
    greedy = _colocated(prompts, [SamplingParams(max_tokens=12, ignore_eos=True)] * len(prompts))
    for rid in want:
        assert got[rid].tokens == want[rid].tokens, rid
    # the sampling is really random: it departs from greedy
    assert sum(want[r].tokens != greedy[r].tokens for r in want) >= 15


@pytest.mark.timeout(60)
@pytest.mark.parametrize("budget", [4096, 7])
def test_layer_hook_sees_each_layer_written(budget: int) -> None:
    """WRITE mode: when the hook runs for layer i of a chunk, layer i's K/V of the chunk's tokens
    are final and layer i+1's not yet written; the chunks cover the prompt in order."""
    engine = tiny_engine("prefill", max_num_seqs=1, max_num_batched_tokens=budget)
    prompt = prompts_for_block_size(BLOCK_SIZE, count=6, seed=2)[5]
    assert len(prompt) > 2 * budget or budget > len(prompt)
    engine.add_request("r", prompt, SamplingParams(max_tokens=4))
    snapshots: list[tuple[int, PrefillChunk, list[torch.Tensor]]] = []

    def hook(layer: int, chunks: list[PrefillChunk]) -> None:
        assert [c.request_id for c in chunks] == ["r"]
        slots = _slots(engine.prefill_blocks("r"), chunks[0].start, chunks[0].end)
        snapshots.append((layer, chunks[0], [k[slots].clone() for k, _ in engine.cache.layers]))

    engine.set_layer_hook(hook)
    run_to_end(engine)
    num_layers = engine.layout.num_layers
    chunks = [c for layer, c, _ in snapshots if layer == 0]
    assert [layer for layer, _, _ in snapshots] == list(range(num_layers)) * len(chunks)
    assert (
        chunks[0].start == 0
        and chunks[-1].is_last
        and all(c.num_prompt_tokens == len(prompt) for c in chunks)
    )
    assert all(a.end == b.start for a, b in itertools.pairwise(chunks))
    assert (len(chunks) > 2) == (budget < len(prompt))
    blocks = engine.prefill_blocks("r")
    for layer, chunk, seen in snapshots:
        final = [k[_slots(blocks, chunk.start, chunk.end)] for k, _ in engine.cache.layers]
        torch.testing.assert_close(seen[layer], final[layer], rtol=0, atol=0)
        if layer + 1 < num_layers:
            assert seen[layer + 1].abs().sum() == 0


def _slots(blocks: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) index of tokens [start, end) of a prompt held in ``blocks``."""
    pos = torch.arange(start, end)
    return torch.tensor(blocks)[pos // BLOCK_SIZE], pos % BLOCK_SIZE


@pytest.mark.timeout(60)
def test_recompute_fallback_equals_colocated() -> None:
    """A decode engine whose transfer failed computes prompt + first token into its reserved blocks,
    and emits only the tokens after the first (its caller has that one from P)."""
    prompts = prompts_for_block_size(BLOCK_SIZE, count=6, seed=4)
    params = SamplingParams(max_tokens=8, temperature=2.0, seed=7, ignore_eos=True)
    prefill, decode = tiny_engine("prefill"), tiny_engine("decode")
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, params)
    firsts = run_to_end(prefill)
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        assert prefill.release(rid)
        assert decode.reserve(rid, prompt, params) is not None
        decode.recompute_reserved(rid, firsts[rid].prefill.first_token)
    rest = run_to_end(decode)
    got = {rid: with_first(firsts[rid], rest[rid]).tokens for rid in firsts}
    want = _colocated(prompts, [params] * len(prompts))
    assert got == {r: v.tokens for r, v in want.items()}
    assert all(len(rest[r].tokens) == 7 for r in rest)  # nothing re-emitted
    assert decode.stats()["num_free_blocks"] == decode.stats()["num_blocks"]


@pytest.mark.timeout(60)
def test_first_token_that_ends_the_request() -> None:
    prompt = [5, 6, 7]
    prefill, decode = tiny_engine("prefill"), tiny_engine("decode")
    params = SamplingParams(max_tokens=1)
    prefill.add_request("r", prompt, params)
    out = run_to_end(prefill)["r"]
    assert out.finished and out.finish_reason == "length" and out.prefill is not None
    # nothing for a peer to read: no lease, every block free at once
    assert out.prefill.block_ids == [] and prefill.stats()["num_free_blocks"] == prefill.stats()["num_blocks"]
    # a decode engine told to start from a token that already ends it finishes with no new token
    blocks = decode.reserve("r", prompt, params)
    assert blocks is not None
    decode.start_decode("r", out.prefill.first_token)
    res = run_to_end(decode)["r"]
    assert res.tokens == [] and res.finished and res.finish_reason == "length"
    assert decode.stats()["num_used_blocks"] == 0


@pytest.mark.timeout(60)
def test_start_decode_refuses_bad_first_tokens() -> None:
    decode = tiny_engine("decode")
    assert decode.reserve("r", [5, 6, 7], SamplingParams(max_tokens=4)) is not None
    for bad in (-1, decode.args.vocab_size, True, 1.5):
        with pytest.raises(InvalidRequest, match="first_token"):
            decode.start_decode("r", bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="no reservation"):
        decode.start_decode("unknown", 5)
