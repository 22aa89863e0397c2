"""A TP = 2 engine on two GPUs (NCCL, CUDA graphs per rank) gives exactly the TP = 1 greedy tokens.

The CPU twin is tests/unit/test_engine_tp.py (gloo). Here both ranks capture their decode graphs
in lockstep (rank 0's capture message) and replay them, all-reduces included.
"""

from __future__ import annotations

import pytest

from tests.unit.tp_procs import reference, run_ranks

PROMPTS = [[40 + (i * 7 + j) % 80 for j in range(n)] for i, n in enumerate([1, 4, 5, 9, 17, 30])]


@pytest.mark.gpu(min_gpus=2)
@pytest.mark.timeout(600)
def test_tp2_engine_on_two_gpus_with_graphs_gives_the_tp1_tokens() -> None:
    from moriio_ray.engine.sampling import SamplingParams

    ref = reference(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True), device="cuda")
    leader, follower = run_ranks(2, PROMPTS, device="cuda", timeout_s=300)
    assert leader["tokens"] == ref["tokens"]
    assert leader["graphs"] > 0
    assert leader["replays"] > 0 and follower["replays"] == leader["replays"]
    assert follower["steps"] == leader["steps"]
