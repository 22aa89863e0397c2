"""Failure rules (DESIGN section 6): worker deaths, cancellation and late transfers leak nothing.

Launches dominate the time, so the tests share pipelines: per mode, one 2P2D pipeline (recompute)
serves a decode worker's death (the pool is whole again once its replacement serves), then the
cancellations, then a prefill worker's death, whose test freezes its driver's view and so closes
it. A decode death with ``fail`` (first: the two shared pipelines take the cluster's 4 CPUs) and
the late transfers have pipelines of their own.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from moriio_ray import PDPipeline, SamplingParams
from moriio_ray.errors import PeerLost, TransferTimeout
from moriio_ray.transfer.shm_segment import PREFIX, SHM_DIR
from tests.faults import delay_transfers
from tests.integration.helpers import Pipelines, assert_no_leaks, tiny_config, varied_prompts, wait_until
from tests.integration.reference import colocated_tokens

pytestmark = pytest.mark.usefixtures("ray_cpu")

LONG = SamplingParams(max_tokens=120, ignore_eos=True)
PROMPTS = varied_prompts(8, seed=7)


def _config(key: tuple[str, str]) -> Any:
    """(mode, on_transfer_failure) -> the pipeline: 2P2D with recompute, 1P2D with fail."""
    mode, on_failure = key
    roles = {"prefill": 2, "decode": 2} if on_failure == "recompute" else {"decode": 2}
    return tiny_config(
        f"fail-{mode}-{on_failure}", mode=mode, transfer={"on_transfer_failure": on_failure}, **roles
    )


@pytest.fixture(scope="module")
def pipelines(ray_cpu: None) -> Iterator[Pipelines]:
    with Pipelines(_config) as pipes:
        yield pipes


@pytest.fixture(scope="module")
def long_reference() -> dict[tuple[int, ...], list[int]]:
    """PROMPTS' colocated tokens under LONG."""
    return {tuple(ids): want for ids, want in zip(PROMPTS, colocated_tokens(PROMPTS, LONG), strict=True)}


def _member(pipe: PDPipeline, key: str) -> Any:
    return ray.get(pipe.coordinator.lookup.remote(key))


def _epoch(pipe: PDPipeline, key: str) -> int:
    m = _member(pipe, key)
    return 0 if m is None else m.epoch


async def _consume(pipe: PDPipeline, ids: list[int], params: SamplingParams, seen: dict[str, Any]) -> Any:
    """Stream one request; record which decode worker serves it and how many tokens came."""
    tokens: list[int] = []
    rid = f"r{len(seen)}-{random.getrandbits(32)}"
    seen[rid] = {"ids": ids, "tokens": tokens, "decode": set(), "error": None, "ended": None}
    try:
        async for ev in pipe.stream(token_ids=ids, params=params, request_id=rid):
            tokens.extend(ev.token_ids)
            seen[rid]["decode"].add(ev.decode_worker)
    except Exception as exc:
        seen[rid]["error"] = exc
    seen[rid]["ended"] = time.monotonic()
    return seen[rid]


async def _run_until(pipe: PDPipeline, params: SamplingParams, n: int, min_tokens: int, action: Any) -> dict:
    """Start n streams; once each has min_tokens, run ``action`` (a kill); then wait for all."""
    seen: dict[str, Any] = {}
    prompts = PROMPTS[:n]
    tasks = [asyncio.ensure_future(_consume(pipe, p, params, seen)) for p in prompts]
    deadline = time.monotonic() + 60
    while not (len(seen) == n and all(len(s["tokens"]) >= min_tokens for s in seen.values())):
        assert time.monotonic() < deadline, "streams did not start"
        await asyncio.sleep(0.01)
    killed_at = time.monotonic()
    action()
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    return {"seen": seen, "killed_at": killed_at}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("mode", "on_failure"), [("read", "fail"), ("read", "recompute"), ("write", "recompute")]
)
def test_decode_worker_killed_mid_stream(
    pipelines: Pipelines, long_reference: dict[tuple[int, ...], list[int]], mode: str, on_failure: str
) -> None:
    pipe = pipelines.get((mode, on_failure))
    victim = f"{pipe.config.name}-decode-0"
    try:
        member = _member(pipe, victim)
        actor, victim_pid, old_epoch = member.actor, member.info.engine_desc.pid, member.epoch
        out = pipe._sync(_run_until(pipe, LONG, 8, 5, lambda: ray.kill(actor, no_restart=True)))
        on_victim = [s for s in out["seen"].values() if victim in s["decode"]]
        others = [s for s in out["seen"].values() if victim not in s["decode"]]
        assert on_victim, "no request was served by the killed worker"
        for s in others:
            assert s["error"] is None and s["tokens"] == long_reference[tuple(s["ids"])]
        for s in on_victim:
            want = long_reference[tuple(s["ids"])]
            if on_failure == "fail":
                assert isinstance(s["error"], PeerLost), s["error"]
                assert s["ended"] - out["killed_at"] < 5.0
                assert s["tokens"] == want[: len(s["tokens"])]
            else:  # continued on another pair from the tokens streamed: the colocated tokens
                assert s["error"] is None and s["tokens"] == want
        # The coordinator replaces the dead worker at a new epoch, and the replacement serves.
        wait_until(lambda: _epoch(pipe, victim) == old_epoch + 1, 30, "a replacement decode worker")
        # The SIGKILLed worker's shared memory is swept by its replacement.
        assert not list(SHM_DIR.glob(f"{PREFIX}{victim_pid}-*"))
        wait_until(
            lambda: (
                pipe.router.membership.find(victim) is not None
                and pipe.router.membership.find(victim).epoch == old_epoch + 1
            ),
            10,
            "the router to see it",
        )
        results = pipe.generate_batch(
            varied_prompts(6, seed=3), SamplingParams(max_tokens=4), max_concurrency=1
        )
        assert any(r.decode_worker == victim for r in results)
        assert pipe.stats()["workers"][victim]["requests"] > 0
        assert_no_leaks(pipe)
    finally:
        if on_failure == "fail":
            pipelines.close((mode, on_failure))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["read", "write"])
def test_cancelling_streams_leaks_nothing(pipelines: Pipelines, mode: str) -> None:
    pipe = pipelines.get((mode, "recompute"))
    rng = random.Random(11)
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    async def one(ids: list[int], cancel_after: int | None) -> int:
        agen = pipe.stream(token_ids=ids, params=params)
        n = 0
        try:
            async for ev in agen:
                n += len(ev.token_ids)
                if cancel_after is not None and n >= cancel_after:
                    break
        finally:
            await agen.aclose()
        return n

    async def run() -> list[Any]:
        prompts = varied_prompts(40, seed=9)
        jobs = []
        for i, ids in enumerate(prompts):
            cancel = rng.choice([0, 1, 3, 10, 25]) if i % 5 == 0 else None  # 20 % cancelled
            task = asyncio.ensure_future(one(ids, cancel))
            if i % 10 == 5:  # and two more cancelled as tasks, wherever they are
                asyncio.get_running_loop().call_later(rng.uniform(0.0, 0.3), task.cancel)
            jobs.append(task)
        return await asyncio.gather(*jobs, return_exceptions=True)

    out = pipe._sync(run())
    finished = [n for n in out if isinstance(n, int) and n == 40]
    assert len(finished) >= 28
    assert_no_leaks(pipe)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["read", "write"])
def test_prefill_worker_killed_is_retried(pipelines: Pipelines, mode: str) -> None:
    pipe = pipelines.get((mode, "recompute"))
    name = pipe.config.name
    try:
        pipe._sync(pipe._refresh())
        # Freeze this driver's view of the membership, so that requests still go to the dead P
        # (its death is seen at once by the coordinator's death watch: no refresh may follow).
        # This pipeline serves no later test.
        pipe.watch.stop()
        pipe.watch.ensure = lambda: False  # type: ignore[method-assign]
        old_epoch = _epoch(pipe, f"{name}-prefill-0")
        ray.kill(_member(pipe, f"{name}-prefill-0").actor, no_restart=True)
        prompts = varied_prompts(12, seed=5)
        results = pipe.generate_batch(
            prompts, SamplingParams(max_tokens=6, ignore_eos=True), max_concurrency=12
        )
        assert all(len(r.token_ids) == 6 for r in results)
        assert all(r.prefill_worker == f"{name}-prefill-1" for r in results)
        assert pipe.flows.counters["prefill_retries"] >= 1
        wait_until(
            lambda: _epoch(pipe, f"{name}-prefill-0") == old_epoch + 1, 30, "a replacement prefill worker"
        )
        assert_no_leaks(pipe)
    finally:
        pipelines.close((mode, "recompute"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_failure", ["recompute", "fail"])
def test_transfer_delayed_past_deadline(on_failure: str) -> None:
    """A read that would finish only after ``delay_s`` ends at its 1 s deadline; D frees its own
    blocks, and releases P's lease, once the late read is over for it (none expires)."""
    name = f"delay-{on_failure}"
    delay_s = 30.0  # far past the transfer's deadline (1 s): the bounds below can be generous
    grace_s = 2.0
    transfer = {
        "timeout_s": 1.0,
        "kv_lease_s": 30.0,
        "lease_grace_s": grace_s,
        "on_transfer_failure": on_failure,
    }
    pipe = PDPipeline.launch(tiny_config(name, transfer=transfer))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    # one block and a token: the second run finds the first block in D's prefix cache and reads
    # only the partial tail (a prompt of whole blocks would need no read at all)
    prompt = varied_prompts(4, seed=2)[3]
    p_key, d_key = f"{name}-prefill-0", f"{name}-decode-0"
    try:
        expected = pipe.generate(token_ids=prompt, params=params).token_ids
        d = _member(pipe, d_key).actor
        ray.get(d.call.remote(delay_transfers, delay_s))
        t0 = time.monotonic()
        if on_failure == "recompute":
            result = pipe.generate(token_ids=prompt, params=params)
            assert result.token_ids == expected
            assert result.timings.recomputed
        else:
            with pytest.raises(TransferTimeout):
                pipe.generate(token_ids=prompt, params=params)
        assert time.monotonic() - t0 < delay_s / 2  # gave up at the transfer deadline, not the delay
        assert pipe.stats()["workers"][d_key]["transfer_failures"] == 1
        # The late read may still be reading P's blocks: D quarantines its blocks until the read
        # has ended, at most transfer timeout + grace (3 s), and only then releases P's lease,
        # long before it could expire (lease + grace = 32 s).
        wait_until(lambda: pipe.stats()["workers"][p_key]["num_leased_blocks"] == 0, 20, "P's lease released")
        assert time.monotonic() - t0 >= grace_s, "P's lease was released while D still quarantined the read"
        assert pipe.stats()["workers"][p_key]["expired_leases"] == 0
        ray.get(d.call.remote(delay_transfers, 0.0))
        assert_no_leaks(pipe, timeout_s=20)  # D's blocks: once the late read is over for D
    finally:
        pipe.shutdown()
