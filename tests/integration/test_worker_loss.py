"""Losing workers for good: a request whose D dies twice, a pool that does not replace its dead
(``runtime.replace_dead_workers: false``), and a start that passes ``runtime.worker_start_timeout_s``."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
from ray.util import placement_group_table

from moriio_ray import PDPipeline, SamplingParams
from moriio_ray.coordinator.actor import NAMESPACE, coordinator_name
from moriio_ray.errors import CapacityError, DeadlineExceeded, PeerLost
from tests.integration.helpers import assert_no_leaks, tiny_config, varied_prompts, wait_until
from tests.integration.rules import actor, deaths, epoch, reference
from tests.worker_faults import slow_steps

pytestmark = pytest.mark.usefixtures("ray_cpu")


@pytest.mark.timeout(240)
def test_a_second_d_death_ends_the_request_and_nothing_is_replaced() -> None:
    name = "no-replace"
    d0, d1 = f"{name}-decode-0", f"{name}-decode-1"
    # pings every second: no healthy worker is taken for dead on a loaded host
    runtime = {"replace_dead_workers": False, "health_check_period_s": 1.0}
    config = tiny_config(name, decode=2, runtime=runtime)
    assert config.transfer.on_transfer_failure == "recompute"
    pipe = PDPipeline.launch(config)
    try:
        prompt = varied_prompts(4, seed=5)[3]
        params = SamplingParams(max_tokens=300, ignore_eos=True)
        expected = reference([prompt], params)[0][0]
        for key in (d0, d1):  # 300 steps of at least 20 ms: the stream outlives both kills
            ray.get(actor(pipe, key).call.remote(slow_steps, 0.02), timeout=30)
        actors = {key: actor(pipe, key) for key in (d0, d1)}

        async def run() -> tuple[list[int], list[str], BaseException | None]:
            tokens: list[int] = []
            killed: list[str] = []
            try:
                async for ev in pipe.stream(token_ids=prompt, params=params):
                    tokens.extend(ev.token_ids)
                    serving = ev.decode_worker
                    if len(tokens) >= 5 + 20 * len(killed) and serving not in killed and len(killed) < 2:
                        assert serving is not None
                        killed.append(serving)
                        ray.kill(actors[serving], no_restart=True)
            except Exception as exc:
                return tokens, killed, exc
            return tokens, killed, None

        tokens, killed, error = pipe._sync(asyncio.wait_for(run(), 120))
        assert sorted(killed) == [d0, d1], killed
        # continued once on the other pair (from the tokens streamed), then ended by the second death
        assert isinstance(error, PeerLost), error
        assert tokens == expected[: len(tokens)] and len(tokens) >= 25
        # nothing is replaced: no member, nothing starting, both deaths recorded at epoch 1 (the
        # second death reaches the coordinator by the caller's report or its next ping: wait for it)
        wait_until(lambda: len(deaths(pipe)) >= 2, 15, "the coordinator to record both deaths")
        stats = ray.get(pipe.coordinator.stats.remote(), timeout=60)
        assert stats["starting"] == [], stats["starting"]
        assert {(d["key"], d["epoch"]) for d in stats["deaths"]} == {(d0, 1), (d1, 1)}
        assert epoch(pipe, d0) == epoch(pipe, d1) == 0
        wait_until(lambda: not pipe.router.membership.by_role("decode"), 30, "the router to drop both D")
        with pytest.raises(CapacityError, match="no live decode worker"):
            pipe.generate(token_ids=prompt, params=params)
        assert set(pipe.stats()["workers"]) == {f"{name}-prefill-0"}
        assert_no_leaks(pipe)
        assert len(deaths(pipe)) == 2
    finally:
        pipe.shutdown()


@pytest.mark.timeout(120)
def test_an_expired_worker_start_timeout_fails_the_launch_and_leaves_nothing() -> None:
    """Detached, as the Serve ingress launches: the coordinator outlives the failed launch, and must
    hold no placement group and no worker (a later start tries again)."""
    name = "start-timeout"
    groups_before = set(placement_group_table())
    t0 = time.monotonic()
    with pytest.raises((DeadlineExceeded, CapacityError), match="worker_start_timeout_s"):
        PDPipeline.launch(tiny_config(name, runtime={"worker_start_timeout_s": 0.5}), detached=True)
    assert time.monotonic() - t0 < 60
    coordinator = ray.get_actor(coordinator_name(name), namespace=NAMESPACE)
    try:
        assert ray.get(coordinator.stats.remote(), timeout=30)["workers"] == {}

        def released() -> bool:
            new = {k: v for k, v in placement_group_table().items() if k not in groups_before}
            return bool(new) and all(v["state"] == "REMOVED" for v in new.values())

        wait_until(released, 30, "the failed pool's placement group to be removed")
    finally:
        ray.kill(coordinator, no_restart=True)
