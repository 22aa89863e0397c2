"""D's ``deliver`` (P's hand-over, driven in-process without Ray): its return is what frees P's
lease, so it must return however the request ends, and leave no record behind."""

from __future__ import annotations

import asyncio
import time

import pytest

from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.protocol import wire
from moriio_ray.protocol.messages import GenRequest, KVHandle
from tests.unit.test_worker_isolation import _worker


def _handle(rid: str) -> KVHandle:
    return KVHandle(
        first_token=65,
        first_logprob=None,
        prefill_done_unix=time.time(),
        prefill_s=0.0,
        transfer_id=rid,
        engine_key="gone-prefill-0",  # never reached: the request ends before its read
        epoch=1,
        block_ids=[0],
        num_tokens=3,
        lease_deadline_unix=time.time() + 30.0,
    )


@pytest.mark.timeout(60)
def test_an_abort_before_the_requests_task_ran_still_ends_the_call() -> None:
    """The caller's abort can land after ``deliver`` spawned the request's task and before that
    task first ran: a task cancelled then never runs its own clean-up. The call must still return
    (else P holds its lease until it expires) and D must forget the request."""

    async def run() -> dict[str, object]:
        d = _worker("decode", "deliver-race")
        await d.ready()
        req = GenRequest(request_id="r", prompt_token_ids=[65, 66, 67], params=SamplingParams(max_tokens=4))
        call = asyncio.ensure_future(d.deliver([(wire.pack(req), wire.pack(_handle("r")), "caller")]))
        await asyncio.sleep(0)  # deliver runs to its wait: the request's task is queued, not started
        task = d.core.table.get("r").task  # type: ignore[union-attr]
        assert task is not None and not task.done()
        await d.abort("r")
        await asyncio.wait_for(call, 5.0)  # returned: P would free its lease now
        stats = await d.stats()
        await d.shutdown()
        return stats

    stats = asyncio.run(run())
    assert stats["live_requests"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_blocks"], stats


@pytest.mark.timeout(60)
def test_a_batch_of_hand_overs_answers_each_once_all_have_ended() -> None:
    """``deliver`` takes P's batch: every hand-over gets its own outcome, and the call returns only
    once none of their blocks on P is needed (here: each request cancelled before its read)."""

    async def run() -> tuple[list[str | None], dict[str, object]]:
        d = _worker("decode", "deliver-batch")
        await d.ready()
        reqs = [
            GenRequest(request_id=rid, prompt_token_ids=[65, 66, 67], params=SamplingParams(max_tokens=4))
            for rid in ("a", "b")
        ]
        items = [(wire.pack(r), wire.pack(_handle(r.request_id)), "caller") for r in reqs]
        call = asyncio.ensure_future(d.deliver(items))
        for _ in range(20):  # until both requests' tasks are spawned
            await asyncio.sleep(0)
            if all(d.core.table.get(r.request_id) is not None for r in reqs):
                break
        assert not call.done()
        await d.abort("a")
        await d.abort("b")
        outcomes = await asyncio.wait_for(call, 5.0)
        stats = await d.stats()
        await d.shutdown()
        return outcomes, stats

    outcomes, stats = asyncio.run(run())
    assert len(outcomes) == 2, outcomes
    assert stats["live_requests"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
