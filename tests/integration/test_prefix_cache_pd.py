"""Prefix caching across P and D on Ray: each request moves only the blocks D lacks, and the tokens
are those of a colocated run with the cache off.

For READ and WRITE, one 1P1D pipeline serves, for each split of a prompt between D's cache and the
transfer, a warm-up request and then the prompt itself: D holds none of it, part of it, all but the
last partial block, or all of it (a full hit: no transfer at all, and P's lease is released at
once). The bytes moved are exactly the blocks D lacks.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from moriio_ray import PDPipeline, SamplingParams
from tests.integration.helpers import BLOCK_SIZE, assert_no_leaks, tiny_config
from tests.integration.reference import colocated_tokens

pytestmark = pytest.mark.usefixtures("ray_cpu")

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # tiny: layers x K/V x block_size x KV heads x head_dim x float32


def _tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]


def splits() -> list[tuple[str, list[int] | None, list[int], int, int]]:
    """(name, warm-up prompt, prompt, blocks D holds when it arrives, prompt tokens P holds then)."""
    rng = random.Random(23)
    shared = _tokens(35, rng)  # 2 full blocks, then the warm-up's own tokens
    odd = _tokens(50, rng)  # 3 full blocks and 2 tokens
    even = _tokens(48, rng)  # exactly 3 blocks
    return [
        ("none", None, _tokens(50, rng), 0, 0),
        ("part", shared, shared + _tokens(15, rng), 2, 32),
        ("all_but_the_partial_block", odd, odd, 3, 48),
        ("everything", even, even, 3, 32),  # P computes at least the last token: its last block
    ]


def _decode_stats(pipe: PDPipeline, role: str) -> dict[str, Any]:
    (w,) = [w for w in pipe.stats()["workers"].values() if w["role"] == role]
    return w


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["read", "write"])
def test_each_split_moves_only_what_d_lacks(mode: str) -> None:
    cases = splits()
    prompts = [p for _, warm, p, *_ in cases for p in ([warm] if warm else []) + [p]]
    reference = dict(zip(map(tuple, prompts), colocated_tokens(prompts, GREEDY), strict=True))
    pipe = PDPipeline.launch(tiny_config(f"prefix-{mode}", mode=mode))
    try:
        for name, warm, prompt, held, p_cached in cases:
            if warm is not None:
                assert pipe.generate(token_ids=warm, params=GREEDY).token_ids == reference[tuple(warm)]
            before = _decode_stats(pipe, "decode" if mode == "read" else "prefill")["transfers"]
            r = pipe.generate(token_ids=prompt, params=GREEDY)
            assert r.token_ids == reference[tuple(prompt)], name
            assert r.num_cached_tokens == p_cached, name  # what usage.prompt_tokens_details reports
            lacking = -(-len(prompt) // BLOCK_SIZE) - held
            moved = _decode_stats(pipe, "decode" if mode == "read" else "prefill")["transfers"] - before
            if mode == "read":  # D reads only the tail; a full hit reads nothing
                assert (r.timings.transfer_bytes or 0) == lacking * BLOCK_BYTES, name
                assert moved == (1 if lacking else 0), name
            else:  # P pushes only the blocks D's reservation does not hold
                assert r.timings.transfer_bytes == lacking * BLOCK_BYTES, name
            assert r.timings.recomputed is False
            assert_no_leaks(pipe)  # P's lease is released, a full hit's too
        cache = _decode_stats(pipe, "decode")["prefix_cache"]
        assert cache["num_hit_tokens"] == sum(case[3] for case in cases) * BLOCK_SIZE
        assert _decode_stats(pipe, "prefill")["prefix_cache"]["num_hit_tokens"] > 0
    finally:
        pipe.shutdown()
