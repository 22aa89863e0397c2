"""A bounded chaos run: workers killed under load, with some requests cancelled, in READ and WRITE.

Requests stream through a 2P2D pipeline (8 in flight) while a killer takes down a random prefill
worker and a random decode worker, 0.5-1.5 s apart (both are down together for a while; each role
keeps a live worker), and about 10 % of the requests are cancelled at a random point. Checks, for
every request: it ends (no request outlives its bound), a completed one carries exactly the colocated
engine's greedy tokens, a failed one fails with a typed error (``MoriioRayError``), never anything
else. After the run every killed worker has been replaced, the pipeline serves a valid request
and no engine holds a block, a lease or a reservation.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field

import pytest
import ray

from moriio_ray import PDPipeline, SamplingParams
from moriio_ray.errors import MoriioRayError
from tests.integration.helpers import assert_no_leaks, tiny_config, varied_prompts, wait_until
from tests.integration.reference import colocated_tokens

pytestmark = pytest.mark.usefixtures("ray_cpu")

KILL_AFTER_S = (0.5, 1.5)  # the wait before each kill
REPLACE_BOUND_S = 45.0  # a killed worker's replacement must be serving within this
CONCURRENCY = 8
CANCEL_SHARE = 0.10
MAX_TOKENS = 32
REQUEST_BOUND_S = 45.0  # no request may take longer than this, kills included
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = varied_prompts(24, seed=21)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """PROMPTS' colocated tokens (both modes' runs are held against them)."""
    return colocated_tokens(PROMPTS, PARAMS)


@dataclass
class Outcome:
    prompt: int
    cancel_after: int | None
    tokens: list[int] = field(default_factory=list)
    error: BaseException | None = None
    took_s: float = 0.0


async def _one(pipe: PDPipeline, prompt: int, ids: list[int], cancel_after: int | None) -> Outcome:
    out = Outcome(prompt, cancel_after)
    start = time.monotonic()
    agen = pipe.stream(token_ids=ids, params=PARAMS)
    try:
        async for ev in agen:
            out.tokens.extend(ev.token_ids)
            if cancel_after is not None and len(out.tokens) >= cancel_after:
                break
    except Exception as exc:
        out.error = exc
    finally:
        await agen.aclose()
        out.took_s = time.monotonic() - start
    return out


async def _load(
    pipe: PDPipeline, prompts: list[list[int]], rng: random.Random, killer: threading.Thread
) -> list[Outcome]:
    """Keep CONCURRENCY requests in flight while the killer runs, and one second more (bounded);
    return every request's outcome."""
    sem = asyncio.Semaphore(CONCURRENCY)
    tasks: list[asyncio.Task[Outcome]] = []

    async def run(i: int, cancel_after: int | None) -> Outcome:
        try:
            outcome = await _one(pipe, i, prompts[i], cancel_after)
            if outcome.error is not None:
                await asyncio.sleep(0.1)  # a client backs off after an error
            return outcome
        finally:
            sem.release()

    stop_at = time.monotonic() + 2 * (KILL_AFTER_S[1] + REPLACE_BOUND_S)
    while time.monotonic() < stop_at:
        if not killer.is_alive():
            stop_at = min(stop_at, time.monotonic() + 1.0)
        await sem.acquire()
        i = rng.randrange(len(prompts))
        cancel_after = rng.randint(0, MAX_TOKENS - 1) if rng.random() < CANCEL_SHARE else None
        tasks.append(asyncio.ensure_future(run(i, cancel_after)))
    return list(await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_BOUND_S + 15))


def _killer(pipe: PDPipeline, name: str, rng: random.Random, killed: list[str]) -> None:
    """Kill one prefill and one decode worker (random ones, in random order), KILL_AFTER_S apart;
    append each key killed; return once both replacements are members. One worker of each role
    stays alive throughout (with every worker of a role down, requests fail fast by design)."""
    victims = [f"{name}-prefill-{rng.randrange(2)}", f"{name}-decode-{rng.randrange(2)}"]
    rng.shuffle(victims)
    epochs: dict[str, int] = {}
    for key in victims:
        time.sleep(rng.uniform(*KILL_AFTER_S))
        member = ray.get(pipe.coordinator.lookup.remote(key))
        ray.kill(member.actor, no_restart=True)
        killed.append(key)
        epochs[key] = member.epoch
    deadline = time.monotonic() + REPLACE_BOUND_S
    for key, epoch in epochs.items():
        while True:
            now = ray.get(pipe.coordinator.lookup.remote(key))
            if now is not None and now.epoch > epoch:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"{key} was not replaced within {REPLACE_BOUND_S} s of the kills")
            time.sleep(0.1)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("backend", "mode"), [("shm", "read"), ("shm", "write")])
def test_kills_and_cancels_under_load(reference: list[list[int]], backend: str, mode: str) -> None:
    name = f"chaos-{backend}-{mode}"
    prompts = PROMPTS
    pipe = PDPipeline.launch(
        tiny_config(
            name,
            backend=backend,
            mode=mode,
            prefill=2,
            decode=2,
            # WRITE: a reservation that a killed P may have pushed into, with no retry that
            # succeeded, stays quarantined to its deadline plus grace: keep that within the run
            transfer={
                "on_transfer_failure": "recompute",
                **({"kv_lease_s": 10.0} if mode == "write" else {}),
            },
        )
    )
    rng = random.Random(f"{backend}-{mode}")
    killed: list[str] = []
    errors: list[BaseException] = []

    def kill() -> None:
        try:
            _killer(pipe, name, random.Random(rng.random()), killed)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    killer = threading.Thread(target=kill, daemon=True)
    try:
        killer.start()
        outcomes = pipe._sync(_load(pipe, prompts, rng, killer))
        killer.join(REPLACE_BOUND_S)
        assert not errors, errors
        assert len(killed) == 2, f"the run killed {killed}"
        completed = [o for o in outcomes if o.error is None and o.cancel_after is None]
        failed = [o for o in outcomes if o.error is not None]
        assert len(outcomes) >= 30, f"only {len(outcomes)} requests ran"
        assert len(completed) >= len(outcomes) // 2, (len(completed), len(outcomes), failed[:3])
        for o in outcomes:
            assert o.took_s < REQUEST_BOUND_S, f"a request took {o.took_s:.1f} s"
            if o.error is not None:
                assert isinstance(o.error, MoriioRayError), f"untyped error: {o.error!r}"
            elif o.cancel_after is None:
                assert o.tokens == reference[o.prompt], f"prompt {o.prompt}: wrong tokens"
            else:
                assert o.tokens == reference[o.prompt][: len(o.tokens)], f"prompt {o.prompt}: wrong prefix"

        # Every killed worker has come back (the killer waited for it) and the router sees it; the
        # pipeline serves and nothing stays held.
        def routed() -> bool:
            for key in killed:
                now, seen = ray.get(pipe.coordinator.lookup.remote(key)), pipe.router.membership.find(key)
                if seen is None or seen.epoch != now.epoch:
                    return False
            return True

        wait_until(routed, 20, "the router to see the replacements")
        after = pipe.generate_batch(prompts[:4], PARAMS, max_concurrency=4)
        assert [r.token_ids for r in after] == reference[:4]
        assert_no_leaks(pipe, timeout_s=20)
    finally:
        pipe.shutdown()
