"""Every remote await on the caller's side has a deadline: a coordinator that never answers makes
the caller's calls fail in bound with ``DeadlineExceeded``, not hang. (A member's descriptors travel
in the membership itself, so there is no second await that could hang.)"""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from moriio_ray import PDPipeline
from moriio_ray.coordinator import actor as coord
from moriio_ray.errors import DeadlineExceeded
from tests.integration.helpers import tiny_config

pytestmark = pytest.mark.usefixtures("ray_cpu")

TIMEOUT_S = 1.0  # runtime.remote_timeout_s of the pipeline under test
POLL_S = 1.0  # the long poll's own wait
# the coordinator's wait for its workers' stats (10 s), which the caller's stats deadline adds to
# remote_timeout_s: shortened for this caller
WORKER_STATS_TIMEOUT_S = 1.0
BOUND_S = 10.0  # every call below must have failed by then (the long poll's wait included)


@ray.remote(num_cpus=0)
class SilentCoordinator:
    """A coordinator that is alive but never answers."""

    async def watch(self, version: int, timeout_s: float) -> bytes:
        await asyncio.sleep(3600)
        return b""

    async def stats(self) -> dict[str, object]:
        await asyncio.sleep(3600)
        return {}


@pytest.mark.timeout(120)
def test_a_silent_coordinator_fails_the_callers_calls_in_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coord, "WORKER_STATS_TIMEOUT_S", WORKER_STATS_TIMEOUT_S)
    config = tiny_config("silent", runtime={"remote_timeout_s": TIMEOUT_S})
    silent = SilentCoordinator.remote()
    pipe = PDPipeline(silent, config)
    try:
        for call in (lambda: pipe._refresh(), lambda: pipe._refresh(timeout_s=POLL_S), pipe.stats_async):
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                pipe._sync(call())
            assert time.monotonic() - t0 < BOUND_S
    finally:
        if pipe._bg is not None:
            pipe._bg.stop()
        ray.kill(silent)
