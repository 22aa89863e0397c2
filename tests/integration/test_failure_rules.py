"""docs/architecture.md "Failures", rule by rule, through one running pipeline (1P2D, tcp, READ) on the CPU:
the cluster token, stop strings and log probabilities, a lease left to expire, D's read margin,
KV blocks running out, a call that never answers, P dying during D's read, an engine fault, and
workers that are stuck but alive. Each test leaves the pool whole (it waits for any replacement)
and ends with every engine's blocks free.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from moriio_ray import PDPipeline, SamplingParams
from moriio_ray.config import TransferConfig
from moriio_ray.errors import CapacityError, DeadlineExceeded, EngineFailed, MoriioRayError, TokenRejected
from moriio_ray.protocol import wire
from moriio_ray.protocol.messages import Handoff
from moriio_ray.transfer import create_agent
from tests.faults import delay_transfers
from tests.integration.helpers import assert_no_leaks, tiny_config, varied_prompts, wait_until
from tests.integration.reference import truncate_at_stop
from tests.integration.rules import actor, deaths, epoch, one_request, reference, run_streams, wait_replaced
from tests.worker_faults import (
    DEVICE_ERROR,
    block_event_loop,
    fail_next_step,
    hang_engine_thread,
    ignore_prefills,
    slow_steps,
    stall_reads,
    wait_stalled,
)

NAME = "rules"
P, D0, D1 = f"{NAME}-prefill-0", f"{NAME}-decode-0", f"{NAME}-decode-1"
TOKEN_HEX = "5a" * 32
LEASE_S, GRACE_S, MARGIN_S = 2.0, 0.5, 1.0
REMOTE_TIMEOUT_S = 5.0
PERIOD_S = 0.5  # runtime.health_check_period_s (the default; at 0.25 a loaded host misses pings)
SLACK_S = 15.0  # added to a detection bound: a host with two cores under other load is slow to ping
HANG_S = 600.0  # a hang outlives every test; the coordinator kills the worker long before
CONFIG = tiny_config(
    NAME,
    backend="tcp",
    decode=2,
    transfer={"kv_lease_s": LEASE_S, "lease_grace_s": GRACE_S, "read_margin_s": MARGIN_S, "timeout_s": 10.0},
    runtime={"remote_timeout_s": REMOTE_TIMEOUT_S, "health_check_period_s": PERIOD_S},
)
LONG = SamplingParams(max_tokens=300, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("ray_cpu")


@pytest.fixture(scope="module")
def pipe(ray_cpu: None) -> Iterator[PDPipeline]:
    with pytest.MonkeyPatch.context() as mp:  # read by the launching process only
        mp.setenv("MORIIO_RAY_CLUSTER_TOKEN", TOKEN_HEX)
        launched = PDPipeline.launch(CONFIG)
    try:
        yield launched
    finally:
        launched.shutdown()


@pytest.mark.timeout(60)
def test_the_configured_cluster_token_is_the_one_peers_must_present(pipe: PDPipeline) -> None:
    desc = ray.get(pipe.coordinator.lookup.remote(P)).info.engine_desc
    config = TransferConfig(backend="tcp")
    intruder = create_agent(config, "intruder", token=bytes(32))
    friend = create_agent(config, "friend", token=bytes.fromhex(TOKEN_HEX))
    try:
        with pytest.raises(TokenRejected, match="refused the cluster token"):
            intruder.connect(desc)
        friend.connect(desc)  # the token the launching process was given
        assert P in friend.peers()
    finally:
        intruder.close()
        friend.close()


@pytest.mark.timeout(120)
def test_stop_strings_and_logprobs_through_p_and_d(pipe: PDPipeline) -> None:
    prompts = varied_prompts(12, seed=31)
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=True)
    tokens, logprobs = reference(prompts, params)
    decode = pipe.tokenizer.decode
    # a stop string hit on D: a printable character first sampled at position k >= 2
    cases = []
    for i, ids in enumerate(tokens):
        for k in range(2, len(ids)):
            char = decode([ids[k]])
            if len(char) == 1 and char.isprintable() and char not in decode(ids[:k]):
                cases.append((i, k, char))
                break
    on_p = [(i, 0, decode([ids[0]])) for i, ids in enumerate(tokens) if decode([ids[0]]).isalnum()]
    assert len(cases) >= 3 and on_p, "the reference outputs hold no usable stop string"
    for i, k, char in [*cases[:3], on_p[0]]:
        stopped = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=True, stop=[char])
        r = pipe.generate(token_ids=prompts[i], params=stopped)
        assert r.finish_reason == "stop", (i, k, char)
        assert r.token_ids == tokens[i][: k + 1]
        assert r.text == truncate_at_stop(decode(tokens[i][: k + 1]), [char]) and char not in r.text
        assert r.logprobs == pytest.approx(logprobs[i][: k + 1], abs=1e-3)
    whole = pipe.generate(token_ids=prompts[0], params=params)  # no stop: the whole reference
    assert whole.token_ids == tokens[0] and whole.logprobs == pytest.approx(logprobs[0], abs=1e-3)
    assert whole.text == decode(tokens[0])
    assert_no_leaks(pipe)


@pytest.mark.timeout(60)
def test_an_unreleased_lease_expires_in_the_running_worker(pipe: PDPipeline) -> None:
    req = pipe.make_request(token_ids=[65 + i % 50 for i in range(100)], params=SamplingParams(max_tokens=4))
    packed = ray.get(actor(pipe, P).prefill.remote(wire.pack(req), None), timeout=30)  # nobody releases it
    handle = wire.unpack(packed, Handoff)
    assert len(handle.block_ids) == -(-len(req.prompt_token_ids) // 16)

    def leased() -> int:
        return int(pipe.stats()["workers"][P]["num_leased_blocks"])

    expired = pipe.stats()["workers"][P]["expired_leases"]
    assert leased() == len(handle.block_ids)
    wait_until(lambda: leased() == 0, LEASE_S + GRACE_S + 15, "P to free the expired lease", poll_s=0.05)
    freed_unix = time.time()
    # never before lease + grace (the sweep runs every 0.25 s on the engine thread)
    assert freed_unix >= handle.lease_deadline_unix + GRACE_S
    assert pipe.stats()["workers"][P]["expired_leases"] == expired + 1  # by the sweep, not a release
    assert_no_leaks(pipe)


@pytest.mark.timeout(90)
def test_d_gives_up_a_read_at_lease_deadline_minus_read_margin(pipe: PDPipeline) -> None:
    prompt, params, expected = one_request(seed=8, max_tokens=8)
    before = {k: pipe.stats()["workers"][k]["recomputes"] for k in (D0, D1)}
    # A read that ends 1.5 s after it starts: inside the lease (2 s), past lease - margin (1 s).
    for key in (D0, D1):
        ray.get(actor(pipe, key).call.remote(delay_transfers, LEASE_S - MARGIN_S + 0.5), timeout=30)
    try:
        r = pipe.generate(token_ids=prompt, params=params)
    finally:
        for key in (D0, D1):
            ray.get(actor(pipe, key).call.remote(delay_transfers, 0.0), timeout=30)
    assert r.token_ids == expected
    assert r.timings.recomputed, "D waited for a read past lease deadline - read_margin_s"
    after = {k: pipe.stats()["workers"][k]["recomputes"] for k in (D0, D1)}
    assert sum(after.values()) == sum(before.values()) + 1
    assert_no_leaks(pipe)


@pytest.mark.timeout(90)
def test_d_out_of_kv_blocks_waits_within_the_lease_then_fails_typed(pipe: PDPipeline) -> None:
    num_blocks = CONFIG.engine.num_blocks
    assert num_blocks is not None
    # Reservations (nobody decodes into them) take all but 4 blocks of each D, for lease + grace.
    for i, key in enumerate((D0, D1)):
        hog = pipe.make_request(
            token_ids=[65] * 16 * (num_blocks - 4), params=SamplingParams(max_tokens=1), request_id=f"hog-{i}"
        )
        ray.get(actor(pipe, key).reserve.remote(wire.pack(hog)), timeout=30)
    prompt = [66 + i % 40 for i in range(120)]  # 8 blocks
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="no free KV blocks"):
        pipe.generate(token_ids=prompt, params=SamplingParams(max_tokens=4, ignore_eos=True))
    assert time.monotonic() - t0 < REMOTE_TIMEOUT_S + 5.0  # bounded by the lease, not left to hang
    # the unused reservations expire after lease + grace; then nothing is held and D serves again
    assert_no_leaks(pipe, timeout_s=LEASE_S + GRACE_S + 15)
    r = pipe.generate(token_ids=prompt, params=SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(r.token_ids) == 4
    with pytest.raises(CapacityError, match="model's context length is"):  # can never fit: at once
        pipe.generate(token_ids=[65] * (num_blocks * 16 - 8), params=SamplingParams(max_tokens=16))


@pytest.mark.timeout(90)
def test_p_out_of_kv_blocks_queues_the_prompt_until_blocks_free(pipe: PDPipeline) -> None:
    num_blocks = CONFIG.engine.num_blocks
    assert num_blocks is not None
    # A lease nobody releases holds all but 4 of P's blocks until lease + grace (2.5 s).
    hog = pipe.make_request(token_ids=[67] * 16 * (num_blocks - 4), params=SamplingParams(max_tokens=1))
    handle = wire.unpack(ray.get(actor(pipe, P).prefill.remote(wire.pack(hog), None), timeout=30), Handoff)
    prompt, params, expected = one_request(seed=23, max_tokens=4)
    assert len(prompt) > 4 * 16
    r = pipe.generate(token_ids=prompt, params=params)  # waits on P, within remote_timeout_s
    assert r.token_ids == expected
    assert time.time() >= handle.lease_deadline_unix + GRACE_S  # it ran once the lease was swept
    assert_no_leaks(pipe)


@pytest.mark.timeout(90)
def test_a_call_that_never_answers_ends_at_remote_timeout(pipe: PDPipeline) -> None:
    p_epoch = epoch(pipe, P)
    ray.get(actor(pipe, P).call.remote(ignore_prefills, True), timeout=30)
    t0 = time.monotonic()
    try:
        with pytest.raises(DeadlineExceeded):
            pipe.generate(token_ids=[70, 71, 72], params=SamplingParams(max_tokens=4))
    finally:
        ray.get(actor(pipe, P).call.remote(ignore_prefills, False), timeout=30)
    took_s = time.monotonic() - t0
    assert REMOTE_TIMEOUT_S - 0.5 <= took_s < REMOTE_TIMEOUT_S + 10.0, took_s
    assert epoch(pipe, P) == p_epoch  # its loop and engine thread stayed healthy: not replaced
    assert_no_leaks(pipe)


@pytest.mark.timeout(180)
def test_p_dying_during_ds_read_is_recomputed_on_d(pipe: PDPipeline) -> None:
    prompt, params, expected = one_request(seed=17, max_tokens=10)
    p_epoch = epoch(pipe, P)
    failures = sum(pipe.stats()["workers"][k]["transfer_failures"] for k in (D0, D1))
    p_actor = actor(pipe, P)
    ray.get(p_actor.call.remote(stall_reads), timeout=30)
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(pipe.generate, token_ids=prompt, params=params)
        assert ray.get(p_actor.call.remote(wait_stalled, 60.0), timeout=90), "D's read never reached P"
        ray.kill(p_actor, no_restart=True)  # mid-read: P has sent nothing of the KV yet
        killed_s = time.monotonic()
        # the coordinator's next ping fails at once: within a period and a round trip ("about a second")
        wait_until(lambda: epoch(pipe, P) != p_epoch, PERIOD_S + 1.0 + SLACK_S, "the coordinator to see it")
        noticed_s = time.monotonic() - killed_s
        r = result.result(timeout=60)
    assert r.token_ids == expected and r.timings.recomputed
    assert sum(pipe.stats()["workers"][k]["transfer_failures"] for k in (D0, D1)) == failures + 1
    wait_replaced(pipe, P, p_epoch)
    print(f"P's death was noticed {noticed_s:.2f} s after the kill")
    assert pipe.generate(token_ids=prompt, params=params).token_ids == expected
    assert_no_leaks(pipe)


@pytest.mark.timeout(240)
def test_an_engine_fault_fails_every_request_on_it_with_engine_failed(pipe: PDPipeline) -> None:
    prompts = varied_prompts(8, seed=21)
    expected = reference(prompts, LONG)[0]
    epochs = {k: epoch(pipe, k) for k in (P, D0)}
    d0 = actor(pipe, D0)
    ray.get(d0.call.remote(slow_steps, 0.01), timeout=30)  # D0's requests are mid-stream at the fault

    async def fault() -> None:
        await d0.call.remote(fail_next_step)

    outs, _ = pipe._sync(run_streams(pipe, prompts, LONG, min_tokens=5, action=fault))
    on_d0 = [o for o in outs if D0 in o.decode]
    assert on_d0, "no request was served by the faulted decode worker"
    for o, want in zip(outs, expected, strict=True):
        if D0 in o.decode:
            assert isinstance(o.error, EngineFailed) and o.decode == {D0}, (o.error, o.decode)
        else:
            assert o.error is None and o.tokens == want
    # P: the fault comes with the next request's prefill, which ends with the same error.
    ray.get(actor(pipe, P).call.remote(fail_next_step), timeout=30)
    with pytest.raises(EngineFailed, match="retry the request"):
        pipe.generate(token_ids=prompts[0], params=SamplingParams(max_tokens=4))
    for key, old in epochs.items():
        wait_replaced(pipe, key, old)
    reasons = {d["key"]: d["reason"] for d in deaths(pipe) if epochs.get(d["key"]) == d["epoch"]}
    assert all(DEVICE_ERROR in reasons[k] for k in epochs), reasons
    results = pipe.generate_batch(prompts, SamplingParams(max_tokens=300, ignore_eos=True), max_concurrency=8)
    assert [r.token_ids for r in results] == expected
    assert_no_leaks(pipe)


@pytest.mark.timeout(240)
def test_workers_stuck_but_alive_are_declared_dead_and_replaced(pipe: PDPipeline) -> None:
    """D0's engine thread hangs in a call (its asyncio loop still answers pings) and D1's asyncio
    loop blocks (no ping is answered), with requests in flight on both. D1 is dead after two
    missed pings (within 5 health periods); D0 once its thread has been inside one call for longer
    than runtime.remote_timeout_s (then at the next ping). Every request ends within its
    remote_timeout_s deadlines, with a typed error; both workers are replaced."""
    prompts = varied_prompts(6, seed=41)
    epochs = {k: epoch(pipe, k) for k in (D0, D1)}
    actors = {k: actor(pipe, k) for k in (D0, D1)}
    for a in actors.values():
        ray.get(a.call.remote(slow_steps, 0.01), timeout=30)
    gone: dict[str, float] = {}

    async def hang() -> None:
        actors[D1].call.remote(block_event_loop, HANG_S)  # never answers: not awaited
        await actors[D0].call.remote(hang_engine_thread, HANG_S)
        t0 = time.monotonic()
        while len(gone) < 2 and time.monotonic() - t0 < REMOTE_TIMEOUT_S + 60:
            for key in (D0, D1):
                member = await pipe.coordinator.lookup.remote(key)
                if key not in gone and (member is None or member.epoch != epochs[key]):
                    gone[key] = time.monotonic() - t0
            await asyncio.sleep(0.05)

    outs, acted_s = pipe._sync(run_streams(pipe, prompts, LONG, min_tokens=5, action=hang))
    # The bounds (1.25 s; 5.6 s) plus SLACK_S: the coordinator's pings are late on a loaded host.
    assert D1 in gone and gone[D1] < 5 * PERIOD_S + SLACK_S, gone
    assert D0 in gone and REMOTE_TIMEOUT_S - 0.5 <= gone[D0] < REMOTE_TIMEOUT_S + 2.5 * PERIOD_S + SLACK_S, (
        gone
    )
    for o in outs:
        assert isinstance(o.error, MoriioRayError) or (o.error is None and len(o.tokens) == 300), o.error
        assert o.ended_s - acted_s < 2 * REMOTE_TIMEOUT_S + SLACK_S
    for key, old in epochs.items():
        wait_replaced(pipe, key, old)
    reasons = {d["key"]: d["reason"] for d in deaths(pipe) if epochs.get(d["key"]) == d["epoch"]}
    assert "missed" in reasons[D1] or "no health answer" in reasons[D1], reasons
    assert "hung" in reasons[D0], reasons
    assert len(pipe.generate_batch(prompts, SamplingParams(max_tokens=4), max_concurrency=6)) == 6
    assert_no_leaks(pipe)
