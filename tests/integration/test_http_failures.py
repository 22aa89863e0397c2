"""HTTP failure handling over real Ray Serve: the application ``serve run`` builds
(``moriio_ray.serve.build_app``), deployed in this test's Ray cluster with two ingress replicas
over one 1P1D pipeline. Stop strings and logprobs; callers that die (a driver and a Serve replica)
with requests in flight; ``serve.request_timeout_s``; an engine fault before the first token (a
503) and mid-stream (the SSE error event), and /health 503 while the pool lacks a worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import msgspec
import pytest
import ray

from bench.launch import free_port
from moriio_ray import SamplingParams
from moriio_ray.config import ServeConfig
from moriio_ray.engine.tokenizer import load_tokenizer
from moriio_ray.worker.outputs import CALLER_GRACE_S, STREAM_PERIOD_S
from tests.e2e.serving import missing_metrics, readme_metrics
from tests.faults import delay_transfers
from tests.integration.helpers import tiny_config, varied_prompts, wait_until
from tests.integration.http_rules import Pool, Streams, post, wait_health
from tests.integration.reference import truncate_at_stop
from tests.integration.rules import reference
from tests.worker_faults import fail_next_step, live_callers, slow_steps

NAME = "http-rules"
P, D = f"{NAME}-prefill-0", f"{NAME}-decode-0"
# a whole request's bound: the caller-death test's HTTP streams must outlive the wait for three
# callers on D, which a loaded 2-core host stretches to several seconds
REQUEST_TIMEOUT_S = 15.0
TRANSFER_TIMEOUT_S = 2.0
# D keeps the blocks of a late read out of use for at most the transfer's timeout plus this grace
LEASE_GRACE_S = 1.0
CONFIG = msgspec.structs.replace(
    tiny_config(
        NAME,
        transfer={"timeout_s": TRANSFER_TIMEOUT_S, "lease_grace_s": LEASE_GRACE_S},
        # pings every second: at 0.25 s a loaded host misses two of them and a healthy worker is "dead"
        runtime={"health_check_period_s": 1.0},
    ),
    serve=ServeConfig(num_replicas=2, request_timeout_s=REQUEST_TIMEOUT_S),
)
# A caller that died: its last stream runs out (one period), then no stream for the grace, and the
# workers look once a period.
CALLER_GONE_S = STREAM_PERIOD_S + CALLER_GRACE_S + STREAM_PERIOD_S
SLACK_S = 15.0  # on a loaded host everything is late
LONG = {"model": "tiny", "prompt": [65, 66, 67], "max_tokens": 1800, "ignore_eos": True}

pytestmark = pytest.mark.usefixtures("ray_cpu")


@pytest.fixture(scope="module")
def url(ray_cpu: None) -> Iterator[str]:
    from ray import serve

    from moriio_ray.caller.pipeline import PDPipeline
    from moriio_ray.serve import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(CONFIG), name=NAME, route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        wait_health(base, 200, 120)
        yield base
    finally:
        serve.shutdown()
        try:  # the replica that launched the pipeline stops it, unless a test killed that replica
            PDPipeline.connect(NAME, timeout_s=30).shutdown()
        except Exception:
            pass


@pytest.fixture(scope="module")
def pool(url: str) -> Pool:
    return Pool(NAME)


@pytest.mark.timeout(120)
def test_stop_strings_and_logprobs_over_http(url: str, pool: Pool) -> None:
    prompts = varied_prompts(8, seed=31)
    tokens, logprobs = reference(prompts, SamplingParams(max_tokens=24, ignore_eos=True, logprobs=True))
    decode = load_tokenizer(CONFIG.model).decode
    i, k, char = next(
        (i, k, decode([ids[k]]))
        for i, ids in enumerate(tokens)
        for k in range(2, len(ids))
        if decode([ids[k]]).isalnum() and decode([ids[k]]) not in decode(ids[:k])
    )
    body = {"model": "tiny", "prompt": prompts[i], "max_tokens": 24, "ignore_eos": True}
    body |= {"temperature": 0, "logprobs": 0, "stop": [char]}
    want = truncate_at_stop(decode(tokens[i][: k + 1]), [char])
    status, whole = post(url, "/v1/completions", body)
    assert status == 200, whole
    choice = whole["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (want, "stop")
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs[i][: k + 1], abs=1e-3)
    status, frames = post(url, "/v1/completions", {**body, "stream": True})
    assert status == 200 and frames[-1] == "[DONE]", frames
    chunks = [f["choices"][0] for f in frames[:-1]]
    assert "".join(c["text"] for c in chunks) == want and char not in want
    assert chunks[-1]["finish_reason"] == "stop"
    streamed = [lp for c in chunks if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(logprobs[i][: k + 1], abs=1e-3)
    pool.assert_no_leaks()


@pytest.mark.timeout(120)
def test_every_metric_the_readme_lists_is_exported(url: str, pool: Pool) -> None:
    """One read that misses its deadline (a failure, recomputed) among the requests so far; the
    node's Prometheus endpoint then has a sample of each metric docs/serve.md lists."""
    pool.call(D, delay_transfers, TRANSFER_TIMEOUT_S + 30.0)
    try:
        status, body = post(url, "/v1/completions", {**LONG, "max_tokens": 4})
    finally:
        pool.call(D, delay_transfers, 0.0)
    assert status == 200, body
    pool.assert_no_leaks(timeout_s=30)  # also sets the block gauges (the workers' stats)
    node = ray.nodes()[0]
    names = readme_metrics()
    assert "ray_moriio_failures_total" in names and len(names) == 11, names  # prefix-cache gauges too
    missing = missing_metrics([f"{node['NodeManagerAddress']}:{node['MetricsExportPort']}"], names, 60.0)
    assert not missing, missing


@pytest.mark.timeout(120)
def test_request_timeout_ends_a_stream_with_an_error_event(url: str, pool: Pool) -> None:
    pool.call(D, slow_steps, 0.05)  # 1,800 steps of 50 ms: far past the request timeout
    try:
        t0 = time.monotonic()
        status, frames = post(url, "/v1/completions", {**LONG, "stream": True})
        took_s = time.monotonic() - t0
    finally:
        pool.call(D, slow_steps, 0.0)
    assert status == 200 and frames[-1] == "[DONE]" and len(frames) > 2, frames[-3:]
    error = frames[-2]["error"]
    assert error["code"] == "service_unavailable" and f"within {REQUEST_TIMEOUT_S} s" in error["message"]
    assert REQUEST_TIMEOUT_S <= took_s < REQUEST_TIMEOUT_S + SLACK_S
    pool.assert_no_leaks()


@pytest.mark.timeout(300)
def test_callers_that_die_have_their_requests_aborted(url: str, pool: Pool) -> None:
    """A driver (SIGKILL) and a Serve ingress replica (ray.kill) die with streams in flight on D;
    the streams of the other replica are closed by their clients. D aborts the dead callers'
    requests once they opened no output stream for a while, and every block is free again."""
    pool.call(D, slow_steps, 0.05)
    script = textwrap.dedent(
        f"""
        import asyncio
        import ray
        from moriio_ray import PDPipeline, SamplingParams
        ray.init(address={ray.get_runtime_context().gcs_address!r}, namespace="moriio_ray",
                 logging_level="ERROR", log_to_driver=False)
        pipe = PDPipeline.connect({NAME!r})
        params = SamplingParams(max_tokens=1800, ignore_eos=True)

        async def one(i, started):
            async for ev in pipe.stream(token_ids=[70 + i, 71, 72], params=params):
                started.add(i)

        async def main():
            started = set()
            tasks = [asyncio.ensure_future(one(i, started)) for i in range(4)]
            while len(started) < 4:
                await asyncio.sleep(0.05)
            print("CALLER", pipe._output_streams().caller_id, flush=True)
            await asyncio.sleep(600)

        asyncio.run(main())
        """
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    streams: Streams | None = None
    try:
        # the driver first (its start takes seconds): the HTTP streams end at the request timeout
        line = driver.stdout.readline() if driver.stdout is not None else ""
        assert line.startswith("CALLER "), f"the driver did not start its streams: {line!r}"
        driver_caller = line.split()[1]
        streams = Streams(url, LONG, 12)
        streams.wait_started(90)
        # both replicas (Serve spreads 12 streams) and the driver have requests on D
        try:
            wait_until(lambda: len(pool.call(D, live_callers)) == 3, 30, "three callers on D")
        except AssertionError:
            callers = pool.call(D, live_callers)
            raise AssertionError(f"callers on D: {callers}; {_running_replicas()} replicas") from None
        assert driver_caller in pool.call(D, live_callers)
        named = ray.util.list_named_actors(all_namespaces=True)
        replicas = [n for n in named if "OpenAIIngress" in n["name"]]
        assert len(replicas) == 2, replicas
        victim = ray.get_actor(replicas[0]["name"], namespace=replicas[0]["namespace"])
        killed_s = time.monotonic()
        os.kill(driver.pid, signal.SIGKILL)
        ray.kill(victim, no_restart=True)
    except BaseException:
        pool.call(D, slow_steps, 0.0)  # the next tests run at full speed
        raise
    finally:
        if streams is not None:  # the live replica's streams: cancelled at once; the dead one's are broken
            streams.close()
        driver.kill()
        driver.wait(30)
    try:
        bound_s = CALLER_GONE_S + SLACK_S
        wait_until(lambda: not pool.call(D, live_callers), bound_s, "D to abort the dead callers' requests")
    finally:
        pool.call(D, slow_steps, 0.0)
    pool.assert_no_leaks()
    print(f"the dead callers' requests were aborted {time.monotonic() - killed_s:.1f} s after the kill")
    # Serve replaces the replica; the pipeline serves through both again
    wait_until(lambda: _running_replicas() == 2, 120, "Serve to replace the killed replica")
    assert post(url, "/v1/completions", {**LONG, "max_tokens": 4})[0] == 200


def _running_replicas() -> int:
    from ray import serve

    app = serve.status().applications[NAME]
    states = [s for d in app.deployments.values() for s in d.replica_states.items()]
    return sum(n for state, n in states if "RUNNING" in str(state))


@pytest.mark.timeout(240)
def test_an_engine_fault_before_the_first_token_is_a_503(url: str, pool: Pool) -> None:
    old = pool.epoch(P)
    pool.call(P, fail_next_step)
    status, body = post(url, "/v1/completions", {**LONG, "max_tokens": 8, "stream": True})
    assert status == 503, body
    assert body["error"]["type"] == "server_error" and "retry the request" in body["error"]["message"]
    assert "Traceback" not in body["error"]["message"] and "/" not in body["error"]["message"]
    # /health answers 503 from the coordinator noticing the dead P until its replacement is ready
    wait_health(url, 503, 30, poll_s=0.02)
    pool.wait_replaced(P, old)
    wait_health(url, 200, 60)
    assert post(url, "/v1/completions", {**LONG, "max_tokens": 4})[0] == 200
    pool.assert_no_leaks()


@pytest.mark.timeout(240)
def test_an_engine_fault_mid_stream_is_an_sse_error_event(url: str, pool: Pool) -> None:
    old = pool.epoch(D)
    pool.call(D, slow_steps, 0.02)  # 400 steps of 20 ms: mid-stream at the fault
    streams = Streams(url, {**LONG, "max_tokens": 400}, 1)
    streams.wait_started(60)
    pool.call(D, fail_next_step)
    [frames] = streams.join(60)
    assert frames[-1] == "[DONE]" and len(frames) >= 3, frames
    assert all("error" not in f for f in frames[:-2]) and frames[0]["choices"][0]["text"] is not None
    error = frames[-2]["error"]
    assert error["code"] == "service_unavailable" and "retry the request" in error["message"], error
    wait_health(url, 503, 30, poll_s=0.02)
    pool.wait_replaced(D, old)
    wait_health(url, 200, 60)
    assert post(url, "/v1/completions", {**LONG, "max_tokens": 4})[0] == 200
    pool.assert_no_leaks()
