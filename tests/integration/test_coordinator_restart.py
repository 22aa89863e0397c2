"""The coordinator is no single point of failure: killed under load, Ray restarts it, it takes its
pool back (the workers are detached and outlive it), and no request fails meanwhile."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from moriio_ray import PDPipeline, SamplingParams
from tests.integration.helpers import assert_no_leaks, tiny_config, varied_prompts, wait_until
from tests.integration.reference import colocated_tokens
from tests.integration.rules import actor, epoch, wait_replaced

pytestmark = pytest.mark.usefixtures("ray_cpu")

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
BACK_WITHIN_S = 5.0  # the goal: coordinator back and `connect` working within this after the kill


@pytest.mark.timeout(240)
def test_a_killed_coordinator_comes_back_and_no_request_fails() -> None:
    name = "coord-restart"
    pipe = PDPipeline.launch(tiny_config(name))
    prompts = varied_prompts(6, seed=11)
    expected = colocated_tokens(prompts, PARAMS)
    d_key = f"{name}-decode-0"
    stop = threading.Event()
    served: list[int] = []
    failures: list[str] = []

    def load(worker: int) -> None:
        i = worker
        while not stop.is_set():
            k = i % len(prompts)
            try:
                got = pipe.generate(token_ids=prompts[k], params=PARAMS).token_ids
            except Exception as exc:  # every request must be served: none may fail
                failures.append(f"{type(exc).__name__}: {exc}")
            else:
                if got != expected[k]:
                    failures.append(f"request {k}: wrong tokens {got} != {expected[k]}")
                served.append(k)
            i += 1

    try:
        version0 = pipe.router.membership.version
        with ThreadPoolExecutor(4) as pool:
            loads = [pool.submit(load, w) for w in range(4)]
            wait_until(lambda: len(served) >= 8, 60, "the load to run")
            ray.kill(pipe.coordinator, no_restart=False)  # Ray restarts it
            killed_s = time.monotonic()
            during = len(served)
            # a new driver's connect works once it is back: the coordinator restarted and took its pool back
            wait_until(lambda: _connects(name), 30, "connect to work after the kill", poll_s=0.1)
            back_s = time.monotonic() - killed_s
            wait_until(lambda: len(served) >= during + 16, 60, "requests to go on after the kill")
            stop.set()
            for f in loads:
                f.result(timeout=60)
        print(f"the coordinator was back {back_s:.2f} s after its kill; {len(served)} requests served")
        assert not failures, failures[:5]
        stats = pipe.stats()
        assert stats["restarts"] == 1, stats["restarts"]
        assert set(stats["workers"]) == {f"{name}-prefill-0", d_key}, stats["workers"]
        assert all("error" not in w for w in stats["workers"].values()), stats["workers"]
        # membership versions go on rising across the restart, so this caller took the new one
        wait_until(lambda: pipe.router.membership.version > version0, 15, "the router to see the new version")
        assert back_s <= BACK_WITHIN_S, back_s
        # the restarted coordinator still replaces a dead worker
        old = epoch(pipe, d_key)
        ray.kill(actor(pipe, d_key), no_restart=True)
        wait_replaced(pipe, d_key, old)
        assert pipe.generate(token_ids=prompts[0], params=PARAMS).token_ids == expected[0]
        assert_no_leaks(pipe)
    finally:
        stop.set()
        pipe.shutdown()
    # nothing of the pipeline outlives its shutdown: no named worker, no placement group
    named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if name in a["name"]]
    assert named == [], named
    assert _groups(name), "the pipeline's placement group was named"
    wait_until(
        lambda: all(g["state"] == "REMOVED" for g in _groups(name)), 30, "its placement group's removal"
    )


def _connects(name: str) -> bool:
    try:
        other = PDPipeline.connect(name, timeout_s=2.0)
    except Exception:
        return False
    return bool(other.router.membership.members)


@pytest.mark.timeout(180)
def test_a_driver_that_dies_leaves_no_worker_and_no_placement_group() -> None:
    """The workers are detached (they outlive a coordinator that Ray restarts), so they must end
    themselves once their coordinator is gone for good: here a driver that launched its pipeline
    (non-detached, so its coordinator dies with it) is killed."""
    name = "orphan-check"
    script = f"""
import ray, sys, time
ray.init(address={ray.get_runtime_context().gcs_address!r}, namespace="moriio_ray",
         logging_level="ERROR", log_to_driver=False)
from moriio_ray import PDPipeline
from tests.integration.helpers import tiny_config
PDPipeline.launch(tiny_config({name!r}))
print("LAUNCHED", flush=True)
time.sleep(600)
"""
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = driver.stdout.readline() if driver.stdout is not None else ""
        assert line.startswith("LAUNCHED"), f"the driver did not launch its pipeline: {line!r}"
        assert _ours(name), "the pipeline's workers are named"
        killed_s = time.monotonic()
        os.kill(driver.pid, signal.SIGKILL)
        wait_until(lambda: not _ours(name), 60, "the orphaned workers to end themselves", poll_s=0.5)
        print(f"the workers were gone {time.monotonic() - killed_s:.1f} s after their driver died")
        wait_until(
            lambda: all(g["state"] == "REMOVED" for g in _groups(name)), 30, "the orphaned group's removal"
        )
    finally:
        driver.kill()
        driver.wait(30)


def _ours(name: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f":{name}-" in a["name"]]


def _groups(name: str) -> list[dict[str, str]]:
    """The pipeline's placement groups (by name), in any state."""
    return [g for g in ray.util.placement_group_table().values() if g.get("name") == f"moriio_ray:{name}"]


def _removed(name: str) -> bool:
    return all(g["state"] == "REMOVED" for g in _groups(name))
