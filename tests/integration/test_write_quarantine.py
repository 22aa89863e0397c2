"""WRITE: a push that lands late never reaches another request's blocks.

P's pushes are one-sided writes into blocks D reserved. When a WRITE request is cancelled while a
push is still in flight, D keeps the reserved blocks out of use until P reports that its pushes
have ended (or until the reservation's deadline plus grace), as READ quarantines a late read. The
test holds P's pushes (``tests/faults.py`` ``LateWriteAgent``: a held push carries the data it had
when issued), cancels the request, lets a second request ask for the same blocks (D has room for
one prompt only), and then lands the held push: the second request must still decode its own
prompt's KV, exactly as the colocated engine does.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import ray

from moriio_ray import PDPipeline, SamplingParams
from tests.faults import held_writes, hold_writes, pass_writes, release_writes
from tests.integration.helpers import assert_no_leaks, tiny_config
from tests.integration.reference import colocated_tokens

pytestmark = pytest.mark.usefixtures("ray_cpu")

NUM_BLOCKS = 8  # 128 tokens of 16: room for one 100-token prompt and its 28 new tokens
PARAMS = SamplingParams(max_tokens=28, ignore_eos=True)


def _stats(pipe: PDPipeline, key: str) -> dict[str, Any]:
    return pipe.stats()["workers"][key]


@pytest.mark.timeout(180)
def test_a_late_push_never_lands_in_another_requests_blocks() -> None:
    name = "write-late-push"
    first = [(7 * i) % 90 + 32 for i in range(100)]
    second = [(11 * i) % 90 + 32 for i in range(100)]
    expected = colocated_tokens([second], PARAMS)[0]
    pipe = PDPipeline.launch(
        tiny_config(name, mode="write", engine={"num_blocks": NUM_BLOCKS}, transfer={"timeout_s": 20.0})
    )
    p_key, d_key = f"{name}-prefill-0", f"{name}-decode-0"
    try:
        assert pipe.generate(token_ids=second, params=PARAMS).token_ids == expected  # warm, and sane
        p = ray.get(pipe.coordinator.lookup.remote(p_key)).actor
        ray.get(p.call.remote(hold_writes))

        async def scenario() -> list[int]:
            # 1. The first request's pushes are issued and held; D has reserved its 7 blocks.
            doomed = asyncio.ensure_future(_collect(pipe, first))
            deadline = time.monotonic() + 30
            while await p.call.remote(held_writes) == 0:
                assert time.monotonic() < deadline, "P issued no push"
                await asyncio.sleep(0.02)
            # 2. Cancel it while its pushes are held; new pushes go through from now on.
            doomed.cancel()
            await asyncio.gather(doomed, return_exceptions=True)
            assert await p.call.remote(pass_writes) > 0
            # 3. A second request needs D's blocks: the cancelled request's, unless they are kept.
            tokens: list[int] = []
            victim = asyncio.ensure_future(_collect(pipe, second, tokens))
            deadline = time.monotonic() + 30
            while not tokens:
                d = (await pipe.stats_async())["workers"][d_key]
                if d.get("quarantined_requests", 0) > 0:
                    break  # D holds the blocks back (and the second request waits for them)
                assert time.monotonic() < deadline, f"neither a token nor a quarantine: {d}"
                await asyncio.sleep(0.02)
            # 4. The held push lands now.
            assert await p.call.remote(release_writes) > 0
            return await asyncio.wait_for(victim, 60)

        assert pipe._sync(scenario()) == expected, "the second request decoded on foreign KV"
        assert_no_leaks(pipe, timeout_s=20.0)
    finally:
        pipe.shutdown()


async def _collect(pipe: PDPipeline, ids: list[int], into: list[int] | None = None) -> list[int]:
    out = [] if into is None else into
    async for event in pipe.stream(token_ids=ids, params=PARAMS):
        out.extend(event.token_ids)
    return out
