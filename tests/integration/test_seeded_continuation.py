"""A seeded request gives the same tokens however often it moves.

Sampling noise is a pure function of (seed, output position). When the decode worker dies and the
request continues on another pair (``on_transfer_failure: recompute``), the continuation prefills
the prompt plus the tokens already streamed and samples on from the next output position, so that
a seeded request at temperature 1 still returns exactly the colocated engine's tokens.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from moriio_ray import PDPipeline, SamplingParams
from tests.integration.helpers import assert_no_leaks, tiny_config, varied_prompts
from tests.integration.reference import colocated_tokens

pytestmark = pytest.mark.usefixtures("ray_cpu")

PARAMS = SamplingParams(max_tokens=96, temperature=1.0, seed=1234, ignore_eos=True)


async def _stream(pipe: PDPipeline, ids: list[int], out: dict[str, object]) -> None:
    tokens: list[int] = []
    out["tokens"], out["decode"] = tokens, set()
    async for event in pipe.stream(token_ids=ids, params=PARAMS):
        tokens.extend(event.token_ids)
        out["decode"].add(event.decode_worker)  # type: ignore[attr-defined]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["read", "colocated"])
def test_a_seeded_request_keeps_its_tokens_across_a_worker_death(mode: str) -> None:
    name = f"seeded-{mode}"
    roles = {"colocated": 2, "prefill": 0, "decode": 0} if mode == "colocated" else {"decode": 2}
    pipe = PDPipeline.launch(tiny_config(name, transfer={"on_transfer_failure": "recompute"}, **roles))
    prompts = varied_prompts(8, seed=5)
    expected = colocated_tokens(prompts, PARAMS)
    victim = f"{name}-{'colocated' if mode == 'colocated' else 'decode'}-0"
    try:
        actor = ray.get(pipe.coordinator.lookup.remote(victim)).actor

        async def run() -> list[dict[str, object]]:
            seen: list[dict[str, object]] = [{} for _ in prompts]
            tasks = [asyncio.ensure_future(_stream(pipe, p, s)) for p, s in zip(prompts, seen, strict=True)]
            deadline = time.monotonic() + 60
            while not all(len(s.get("tokens", ())) >= 5 for s in seen):  # type: ignore[arg-type]
                assert time.monotonic() < deadline, "the streams did not start"
                await asyncio.sleep(0.01)
            ray.kill(actor, no_restart=True)  # mid-decode for every request on it
            await asyncio.wait_for(asyncio.gather(*tasks), 90)
            return seen

        seen = pipe._sync(run())
        moved = [s for s in seen if victim in s["decode"]]  # type: ignore[operator]
        assert moved, "no request was on the killed worker"
        for i, s in enumerate(seen):
            assert s["tokens"] == expected[i], f"prompt {i} (moved: {victim in s['decode']})"  # type: ignore[operator]
        assert pipe.stats()["flows"]["continuations"] >= len(moved)
        assert_no_leaks(pipe, timeout_s=20.0)
    finally:
        pipe.shutdown()
