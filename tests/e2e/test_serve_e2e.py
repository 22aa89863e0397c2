"""``serve run configs/tiny_1p1d_cpu.yaml`` as a child process, driven over real HTTP, in Serve's
fast path (HAProxy in front of the ingress replica, which serves HTTP itself) as the config sets it.

One server for the session, shared with test_hostile_http.py (startup is the expensive part; see
tests/e2e/conftest.py). The child runs a private Ray cluster in its own process group and temp
dir; the session fixture kills whatever is left of it even when a test fails. The clean-shutdown
test runs last and stops the server with SIGINT (a later user of the fixture gets a new one).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest

from bench.launch import ServeProcess
from moriio_ray.transfer.shm_segment import SHM_DIR
from tests.e2e.serving import (
    Shared,
    haproxy_pids,
    missing_metrics,
    quiet,
    readme_metrics,
    wait_quiet,
    worker_stats,
)

MODEL = "tiny"
MAX_MODEL_LEN = 2048  # configs/tiny_1p1d_cpu.yaml


@pytest.fixture(scope="module")
def server(tiny_serve: Shared) -> ServeProcess:
    """The session's ``serve run configs/tiny_1p1d_cpu.yaml`` (tests/e2e/conftest.py)."""
    return tiny_serve.get()


@pytest.mark.timeout(60)
def test_health_models_stats(server: ServeProcess) -> None:
    assert haproxy_pids(server), "the config's fast path should put HAProxy in front of the ingress"
    status, body = server.get("/health")
    assert status == 200 and body["workers"] == {"prefill": 1, "decode": 1}
    status, body = server.get("/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [MODEL]
    workers = worker_stats(server)
    assert {w["role"] for w in workers.values()} == {"prefill", "decode"}
    assert quiet(workers)


@pytest.mark.timeout(60)
def test_openai_completions(client: openai.OpenAI) -> None:
    whole = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion" and whole.model == MODEL
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert whole.usage is not None and whole.usage.prompt_tokens == len(b"Hello there")
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Hello there",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == choice.finish_reason and all(r is None for r in reasons[:-1])
    assert "".join(texts) == choice.text  # greedy: streaming and not give the same text
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    )
    assert len({c.id for c in chunks}) == 1


@pytest.mark.timeout(60)
def test_openai_chat(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi!"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, temperature=0
    )
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"
    message = whole.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    assert whole.usage is not None and 1 <= whole.usage.completion_tokens <= 10

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


@pytest.mark.timeout(120)
def test_32_concurrent_requests(server: ServeProcess) -> None:
    prompts = [f"prompt number {i % 4}: " + "x" * (i % 4) * 40 for i in range(32)]

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, str, int]:
        out = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert out.usage is not None
        return prompt, out.choices[0].text, out.usage.completion_tokens

    async def run_all() -> list[tuple[str, str, int]]:
        async with openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=90
        ) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(run_all())
    assert len(results) == 32
    by_prompt: dict[str, set[str]] = {}
    for prompt, text, _ in results:
        by_prompt.setdefault(prompt, set()).add(text)
    # greedy decoding under continuous batching: one prompt, one answer, whatever the batch
    assert all(len(texts) == 1 for texts in by_prompt.values()), by_prompt
    assert wait_quiet(server, 10.0)[0]


A = {"model": MODEL, "prompt": "a"}
BAD_INPUTS: list[tuple[str, bytes | dict[str, Any], int, str | None]] = [
    ("invalid JSON", b'{"model": "tiny", "prompt": ', 400, None),
    ("wrong type", {**A, "max_tokens": "ten"}, 400, "max_tokens"),
    ("wrong type prompt", {**A, "prompt": {"text": "a"}}, 400, "prompt"),
    ("max_tokens zero", {**A, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", {**A, "max_tokens": -4}, 400, "max_tokens"),
    ("prompt too long", {**A, "prompt": "y" * (MAX_MODEL_LEN + 5)}, 400, "prompt"),
    ("prompt + max_tokens too long", {**A, "prompt": "y" * 2000, "max_tokens": 100}, 400, "max_tokens"),
    ("unknown model", {**A, "model": "gpt-4o"}, 404, "model"),
    ("transfer params", {**A, "kv_transfer_params": {"do_remote_decode": True}}, 400, "kv_transfer_params"),
    ("peer address", {**A, "remote_host": "10.0.0.9", "remote_port": 5555}, 400, "remote_host"),
    ("refused field", {**A, "suffix": "x"}, 400, "suffix"),
    ("best_of above n", {**A, "best_of": 3}, 400, "best_of"),
    ("n too large", {**A, "n": 17}, 400, "n"),
    ("bad prompt list", {**A, "prompt": ["a", 1]}, 400, "prompt"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("case", "body", "status", "param"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_a_4xx_in_openai_shape(
    server: ServeProcess, case: str, body: bytes | dict[str, Any], status: int, param: str | None
) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(server.base_url + "/v1/completions", content=raw, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    if status == 400:
        assert error["type"] == "invalid_request_error"


@pytest.mark.timeout(60)
def test_bad_chat_input_and_oversized_body(server: ServeProcess) -> None:
    url = server.base_url + "/v1/chat/completions"
    resp = httpx.post(url, json={"model": MODEL, "messages": "hi"}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    resp = httpx.post(
        url, json={"model": MODEL, "messages": [{"role": "user", "content": "a"}], "remote_block_ids": [1]}
    )
    assert resp.status_code == 400 and "cannot set transfer parameters" in resp.json()["error"]["message"]
    resp = httpx.post(url, content=b"[" + b"1," * (9 << 20) + b"1]", timeout=60)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "too_large"


def _decode_used_blocks(server: ServeProcess) -> tuple[float, int, int]:
    """(time, used blocks, running requests) of the decode engine."""
    (w,) = [w for w in worker_stats(server).values() if w["role"] == "decode"]
    return time.monotonic(), w["num_blocks"] - w["num_free_blocks"], w["num_running"]


@pytest.mark.timeout(90)
def test_disconnect_mid_stream_frees_the_blocks(server: ServeProcess) -> None:
    before = wait_quiet(server, 10.0)[2]
    assert quiet(before)
    prompt_tokens, block_tokens = 100, 16
    body = {
        "model": MODEL,
        "prompt": "z" * prompt_tokens,  # 7 blocks on P, read by D
        "max_tokens": MAX_MODEL_LEN - prompt_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", server.base_url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        a = _decode_used_blocks(server)
        for line in lines:  # keep reading for a while: the decode engine's pace, in blocks per second
            if time.monotonic() - a[0] > 0.5 and line.startswith("data: {"):
                break
        b = _decode_used_blocks(server)
        assert b[2] == 1 and b[1] > a[1], f"the decode engine is not generating: {a} -> {b}"
        tokens_per_s = block_tokens * (b[1] - a[1]) / (b[0] - a[0])
        remaining_s = (MAX_MODEL_LEN - block_tokens * b[1]) / tokens_per_s
        assert remaining_s > 1.0, f"the request is nearly done ({b[1]} blocks used); nothing to cancel"
        # leaving the block closes the connection mid-stream
    t_closed = time.monotonic()
    after = wait_quiet(server, 20.0)[2]
    freed_s = time.monotonic() - t_closed
    assert quiet(after), f"blocks not freed {freed_s:.1f} s after the disconnect: {after}"
    for key, w in after.items():
        assert w["num_free_blocks"] == before[key]["num_free_blocks"] == w["num_blocks"]
    # Finishing the request instead of cancelling it would have taken remaining_s.
    assert freed_s < remaining_s / 4, (freed_s, remaining_s)
    status, stats = server.get("/stats")
    assert status == 200 and stats["ingress"]["in_flight"] == 0


@pytest.mark.timeout(120)
def test_backpressure_429_beyond_max_ongoing_requests(server: ServeProcess) -> None:
    """64 streams held open fill the replica; the next 8 requests get 429 at once."""
    limit, extra = 64, 8  # serve.max_ongoing_requests in configs/tiny_1p1d_cpu.yaml
    prompt = "q" * 20
    # As long as the context allows, so that no held stream can finish while the test runs.
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_MODEL_LEN - 64, "ignore_eos": True}

    async def run() -> tuple[list[int], list[int]]:
        held: list[int] = []
        all_held = asyncio.Event()
        release = asyncio.Event()

        async def hold(http: httpx.AsyncClient) -> None:
            async with http.stream(
                "POST", server.base_url + "/v1/completions", json={**body, "stream": True}
            ) as r:
                # Keep a reference to the line iterator: a dropped one is finalised, which closes the
                # response, and the server would rightly see a disconnect and free the slot.
                lines = r.aiter_lines()
                if r.status_code == 200:
                    async for line in lines:  # hold the stream open past its first token
                        if line.startswith("data: {"):
                            assert '"error"' not in line, line  # an error would end the stream early
                            break
                held.append(r.status_code)
                if len(held) == limit:
                    all_held.set()
                await release.wait()
                del lines

        async def extra_one(http: httpx.AsyncClient) -> int:
            r = await http.post(server.base_url + "/v1/completions", json=body)
            if r.status_code == 429:
                error = r.json()["error"]
                assert error["type"] == "rate_limit_error" and error["message"]
            return r.status_code

        limits = httpx.Limits(max_connections=limit + extra)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            holders = [asyncio.ensure_future(hold(http)) for _ in range(limit)]
            await asyncio.wait_for(all_held.wait(), 90)
            extras = await asyncio.gather(*(extra_one(http) for _ in range(extra)))
            release.set()
            await asyncio.gather(*holders)
        return held, list(extras)

    held, extras = asyncio.run(run())
    _, stats = server.get("/stats")
    assert held == [200] * limit, stats
    assert extras == [429] * extra, stats
    assert wait_quiet(server, 30.0)[0], "the held streams' blocks were not freed"


@pytest.mark.timeout(90)
def test_metrics_on_rays_prometheus_endpoint(server: ServeProcess, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="metrics please", max_tokens=4, temperature=0)
    assert server.get("/stats")[0] == 200  # the block gauges are set when the workers report
    targets = server.metrics_targets()
    assert targets, "Ray wrote no Prometheus service-discovery file"
    # every metric docs/serve.md lists; failures_total has a sample only once a failure happened
    # (tests/integration/test_http_failures.py causes one and checks it)
    names = [n for n in readme_metrics() if n != "ray_moriio_failures_total"]
    assert len(names) == 10, names  # the prefix-cache gauges included
    missing = missing_metrics(targets, names, 60.0)
    assert not missing, f"not exported on any of {targets}: {missing}"


@pytest.mark.timeout(120)
def test_clean_shutdown_on_sigint(server: ServeProcess) -> None:
    pids = set(server.leftover_pids())
    assert server.proc is not None and pids
    # the shm backend keeps each engine's KV cache in a segment named moriio-<pid>-...
    segments = [p for p in SHM_DIR.glob("moriio-*") if int(p.name.split("-")[1]) in pids]
    assert len(segments) == 2, segments
    t0 = time.monotonic()
    rc = server.stop(timeout_s=60)
    stop_s = time.monotonic() - t0
    assert rc == 0, server.log_tail()
    assert stop_s < 60
    left = server.wait_no_leftovers(timeout_s=30)
    assert left == [], f"processes left after serve run exited: {left}"
    assert server.get("/health")[0] == 0  # nothing listens any more
    assert not [p for p in segments if p.exists()], "shared-memory segments left behind"
    log = server.log_tail(1 << 30)  # the whole log: the launch line is near its start
    assert "launched the pipeline 'tiny-1p1d'" in log  # the ingress found no pipeline and started one
    assert "stopped the pipeline 'tiny-1p1d'" in log, "the ingress did not stop the pipeline it launched"
