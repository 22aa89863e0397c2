"""Races between a request's end and its cleanup: nothing a cancelled request owned stays held.

- An ingress-like actor streams requests and the driver cancels its calls recursively right after
  the first token, as Serve does when a client leaves: Ray then also cancels every call that the
  cancelled task submitted and that has not run yet (the aborts, D's release of P's lease, ...).
  Every engine's free blocks must come back at once, not after kv_lease_s + lease_grace_s.
- A read still in flight when its request is cancelled keeps its blocks quarantined until the
  transfer ends (the delay hook holds the transfer), then frees them; P's lease on the blocks the
  read comes from is released only then, not at the cancel.

One 1P1D pipeline per mode; the READ one serves both tests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from moriio_ray import PDPipeline, SamplingParams
from tests.faults import delay_transfers
from tests.integration.helpers import (
    Pipelines,
    assert_no_leaks,
    leaks,
    tiny_config,
    varied_prompts,
    wait_until,
)

pytestmark = pytest.mark.usefixtures("ray_cpu")


@pytest.fixture(scope="module")
def pipelines(ray_cpu: None) -> Iterator[Pipelines]:
    # a read may last the whole of the quarantine test's delay
    with Pipelines(
        lambda mode: tiny_config(f"race-{mode}", mode=mode, transfer={"timeout_s": 15.0})
    ) as pipes:
        yield pipes


@ray.remote(num_cpus=0)
class Ingress:
    """Streams requests like the Serve ingress: from an async actor whose calls get cancelled."""

    def __init__(self) -> None:
        self.pipe: PDPipeline | None = None
        self.first_tokens = 0

    async def connect(self, name: str) -> None:
        self.pipe = await asyncio.to_thread(PDPipeline.connect, name)  # the blocking API, off the loop

    async def stream(self, ids: list[int], params: SamplingParams, started: Any) -> int:
        n = 0
        assert self.pipe is not None
        async for event in self.pipe.stream(token_ids=ids, params=params):
            n += len(event.token_ids)
            if n == len(event.token_ids):
                self.first_tokens += 1
                started.send.remote()  # the driver cancels this call now
        return n

    async def count(self) -> int:
        return self.first_tokens


@ray.remote(num_cpus=0)
class Signal:
    def __init__(self) -> None:
        self.n = 0
        self.event = asyncio.Event()
        self.want = 0

    async def send(self) -> None:
        self.n += 1
        if self.n >= self.want:
            self.event.set()

    async def wait_for(self, n: int) -> None:
        self.want = n
        if self.n < n:
            self.event.clear()
            await self.event.wait()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["read", "write"])
def test_recursive_cancellation_after_the_first_token_leaks_nothing(pipelines: Pipelines, mode: str) -> None:
    pipe = pipelines.get(mode)
    ingress = Ingress.remote()
    ray.get(ingress.connect.remote(pipe.config.name), timeout=60)
    params = SamplingParams(max_tokens=400, ignore_eos=True)  # far longer than the test runs
    try:
        prompts = varied_prompts(16, seed=4)
        done = 0
        for _wave in range(3):
            signal = Signal.remote()
            refs = [ingress.stream.remote(p, params, signal) for p in prompts]
            ray.get(signal.wait_for.remote(len(refs)), timeout=60)
            for ref in refs:
                ray.cancel(ref, recursive=True)  # what Serve does when the client disconnects
            for ref in refs:
                with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError)):
                    ray.get(ref, timeout=60)
            done += len(refs)
        assert ray.get(ingress.count.remote()) == done
        # at once: a lease left to expire would take kv_lease_s + lease_grace_s (35 s)
        assert_no_leaks(pipe, timeout_s=8.0)
    finally:
        ray.kill(ingress)
        if mode == "write":
            pipelines.close(mode)


@pytest.mark.timeout(120)
def test_a_cancelled_read_stays_quarantined_until_the_transfer_ends(pipelines: Pipelines) -> None:
    pipe = pipelines.get("read")
    name = pipe.config.name
    delay_s = 8.0  # long enough to look at every worker while the read is held, on loaded cores
    assert pipe.config.transfer.timeout_s > delay_s  # the read may last the whole delay
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = [7] * 100  # 7 blocks of 16 tokens
    d_key, p_key = f"{name}-decode-0", f"{name}-prefill-0"
    try:
        expected = pipe.generate(token_ids=prompt, params=params).token_ids  # also warms the peers
        d = ray.get(pipe.coordinator.lookup.remote(d_key)).actor
        ray.get(d.call.remote(delay_transfers, delay_s))

        async def cancel_mid_read() -> float:
            agen = pipe.stream(token_ids=prompt, params=params, request_id="mid-read")
            await agen.__anext__()  # P's first token; D's read follows (it holds delay_s)
            t_first = time.monotonic()
            # The first token can reach the caller before P's hand-over reaches D: cancel only once
            # D's read is in flight (its 7 blocks in use), or there is nothing to quarantine.
            while True:
                w = (await pipe.stats_async())["workers"][d_key]
                if w["num_blocks"] - w["num_free_blocks"] == 7:  # reserved; the read is issued
                    await asyncio.sleep(0.1)  # right after (well within the delay_s it is held)
                    break
                assert time.monotonic() - t_first < delay_s / 2, f"D's read did not start: {w}"
                await asyncio.sleep(0.01)
            await agen.aclose()  # the caller stops: D and P are told to abort
            return t_first

        t_first = pipe._sync(cancel_mid_read())
        stats: dict[str, Any] = {}

        def cancelled_everywhere() -> bool:
            nonlocal stats
            stats = pipe.stats()["workers"]
            # D has dropped the request (ray.cancel of its decode call, or the abort)
            return stats[d_key]["live_requests"] == 0 and stats[p_key]["live_requests"] == 0

        wait_until(cancelled_everywhere, delay_s / 2, "D and P to drop the cancelled request")
        p = ray.get(pipe.coordinator.lookup.remote(p_key)).actor
        ray.get(p.abort.remote("mid-read"), timeout=10)  # the caller's abort to P has been served too
        # The caller's abort may land after D's decode call was cancelled (or before): once this
        # one has returned, every abort of the request has been served, and none may free
        # blocks that the read still writes.
        ray.get(d.abort.remote("mid-read"), timeout=10)
        stats = pipe.stats()["workers"]
        t_checked = time.monotonic()
        assert t_checked - t_first < delay_s - 1.0, "too slow to look while the read is still held"
        d_stats = stats[d_key]
        # the read is still in flight: its 7 blocks stay out of use (quarantined), not freed
        assert d_stats["num_blocks"] - d_stats["num_free_blocks"] == 7, d_stats
        assert d_stats["num_running"] == 0 and d_stats["live_requests"] == 0, d_stats
        # the read may still be reading P's blocks: P's lease holds them until the read has ended
        assert stats[p_key]["num_leased_blocks"] == 7, stats[p_key]
        ray.get(d.call.remote(delay_transfers, 0.0))  # later transfers run at full speed
        # once the late transfer has ended, the blocks come back
        wait_until(lambda: leaks(pipe.stats()) == {}, delay_s + 5.0, "the quarantined blocks to be freed")
        assert time.monotonic() - t_first >= delay_s - 0.5, "the blocks were freed before the read ended"
        assert pipe.generate(token_ids=prompt, params=params).token_ids == expected
        assert_no_leaks(pipe)
    finally:
        pipelines.close("read")
