"""Disaggregated greedy tokens equal colocated ones, for both modes and both CPU backends, with and
without chunked prefill (a WRITE push then follows the chunks), overlapped scheduling and the
block-major layout; the pipelines cache prefixes (the default), the colocated reference (the engine
in this process) does not."""

from __future__ import annotations

import pytest

from moriio_ray import PDPipeline, SamplingParams
from tests.integration.helpers import assert_no_leaks, tiny_config, varied_prompts
from tests.integration.reference import colocated_tokens

pytestmark = pytest.mark.usefixtures("ray_cpu")

PROMPTS = varied_prompts(30, seed=1)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    # the prefix cache off: the pipelines below (cache on, the default) must give the same tokens
    return {"greedy": colocated_tokens(PROMPTS, GREEDY), "seeded": colocated_tokens(PROMPTS[:8], SEEDED)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("backend", "mode", "budget", "overlap", "layout"),
    # a budget of 40 tokens a step prefills the longer prompts (up to 120) in chunks, on P and D;
    # overlapped scheduling (the CUDA default) on P and D in two of the four; the block-major
    # layout (each block's layers together) in one
    [
        ("shm", "read", 4096, True, "block_major"),
        ("tcp", "read", 40, False, "layer_major"),
        ("shm", "write", 40, True, "layer_major"),
        ("tcp", "write", 4096, False, "layer_major"),
    ],
)
def test_pd_tokens_equal_colocated(
    reference: dict[str, list[list[int]]], backend: str, mode: str, budget: int, overlap: bool, layout: str
) -> None:
    engine = {"max_num_batched_tokens": budget, "overlap_scheduling": overlap}
    pipe = PDPipeline.launch(
        tiny_config(f"parity-{backend}-{mode}", backend=backend, mode=mode, layout=layout, engine=engine)
    )
    try:
        results = pipe.generate_batch(PROMPTS, GREEDY, max_concurrency=16)
        assert [len(r.token_ids) for r in results] == [12] * len(PROMPTS)
        mismatches = [i for i, r in enumerate(results) if r.token_ids != reference["greedy"][i]]
        assert not mismatches, f"prompts {mismatches} differ from colocated"
        seeded = pipe.generate_batch(PROMPTS[:8], SEEDED, max_concurrency=8)
        assert [r.token_ids for r in seeded] == reference["seeded"]
        for r in results:
            assert r.finish_reason == "length"
            assert r.timings.ttft_s is not None and r.timings.ttft_s > 0
            assert r.timings.handoff_s is not None and r.timings.handoff_s >= 0
            if mode == "read":
                assert (r.timings.transfer_bytes or 0) > 0
        stats = pipe.stats()
        roles = {w["role"]: w for w in stats["workers"].values()}
        assert roles["decode"]["transfer_failures"] == 0 and roles["prefill"]["transfer_failures"] == 0
        moved = roles["decode"]["transfers"] if mode == "read" else roles["prefill"]["transfers"]
        # the seeded run's prompts are cached on D: only what D lacks moves (a prompt of whole
        # blocks: nothing, no transfer at all)
        assert moved == sum(1 for r in results + seeded if r.timings.transfer_bytes) > len(PROMPTS) - 3
        assert roles["decode"]["prefix_cache"]["num_hit_tokens"] > 0

        async def collect() -> list[list[int]]:
            chunks = []
            async for ev in pipe.stream(token_ids=PROMPTS[3], params=GREEDY):
                chunks.append(ev.token_ids)
            return chunks

        chunks = pipe._sync(collect())
        assert [t for c in chunks for t in c] == reference["greedy"][3]
        assert len(chunks) >= 2  # the first token arrives before decoding starts
        assert_no_leaks(pipe)
    finally:
        pipe.shutdown()
