"""Hostile clients against one ``serve run configs/tiny_1p1d_cpu.yaml`` over real HTTP.

- the request that killed the prefill engine (a top_k past int64) is a 400, and P lives on;
- many streams cut right after the headers (or just before, or after the first event) leave no
  block held: every engine's free blocks return promptly, well before kv_lease_s + lease_grace_s;
- property-based bodies over both endpoints: no 5xx, every 4xx OpenAI-shaped, the server answers
  a valid request afterwards, and no block is leaked.
The server is the session's, shared with test_serve_e2e.py (its start is the expensive part).
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from bench.launch import ServeProcess
from tests.e2e.serving import Shared, wait_quiet, worker_stats
from tests.fuzz_bodies import chat_bodies, check_error_body, completion_bodies, encoded

LEASE_PLUS_GRACE_S = 35.0  # transfer.kv_lease_s + lease_grace_s (the defaults the config keeps)
FUZZ = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def server(tiny_serve: Shared) -> ServeProcess:
    """The session's ``serve run configs/tiny_1p1d_cpu.yaml`` (tests/e2e/conftest.py)."""
    return tiny_serve.get()


def _valid_request_works(http: httpx.Client) -> None:
    resp = http.post("/v1/completions", json={"model": "tiny", "prompt": "still there?", "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.timeout(120)
def test_the_top_k_that_killed_the_prefill_engine_is_a_400(server: ServeProcess, http: httpx.Client) -> None:
    before = {key: (w["epoch"], w["requests"]) for key, w in worker_stats(server).items()}
    for top_k in (2**63, 2**64, 10**30, 261):
        for stream in (False, True):
            body = {"model": "tiny", "prompt": "hi", "top_k": top_k, "temperature": 1.0, "stream": stream}
            resp = http.post("/v1/completions", content=json.dumps(body).encode())
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["param"] == "top_k" and error["type"] == "invalid_request_error"
    _valid_request_works(http)
    after = worker_stats(server)
    for key, (epoch, _) in before.items():
        assert after[key]["epoch"] == epoch, f"{key} was replaced: {after[key]}"


async def _cut(base_url: str, body: bytes, when: str, rng: random.Random) -> str:
    """Send one streaming request over a raw socket and drop the connection at ``when``."""
    host, port = base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    writer.write(head + body)
    await writer.drain()
    status = "cut-before"
    try:
        if when == "before_headers":
            await asyncio.sleep(rng.uniform(0.0, 0.05))  # wherever the ingress is meanwhile
        else:
            headers = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
            status = headers.split(b" ", 2)[1].decode()
            if when == "after_first_event":
                await asyncio.wait_for(reader.readuntil(b"\n\n"), 60)
    finally:
        writer.transport.abort()  # a reset, as a client that vanished
    return status


@pytest.mark.timeout(240)
def test_streams_cut_at_the_headers_leave_no_block_held(server: ServeProcess, http: httpx.Client) -> None:
    quiet, _, workers = wait_quiet(server, 20.0, leases=True, poll_s=0.1)
    assert quiet, workers
    rng = random.Random(15)
    body = json.dumps(
        {"model": "tiny", "prompt": "p" * 90, "max_tokens": 1800, "ignore_eos": True, "stream": True}
    ).encode()
    whens = ["right_after_headers"] * 4 + ["before_headers", "after_first_event"]

    async def wave(n: int) -> list[str]:
        return await asyncio.gather(*(_cut(server.base_url, body, rng.choice(whens), rng) for _ in range(n)))

    statuses: list[str] = []
    for _ in range(8):  # 8 waves of 32: each wave's streams would decode for a long while if kept
        statuses += asyncio.run(wave(32))
    assert statuses.count("200") >= 160, statuses
    assert set(statuses) <= {"200", "cut-before"}, statuses
    quiet, freed_s, workers = wait_quiet(server, LEASE_PLUS_GRACE_S, leases=True, poll_s=0.1)
    assert quiet, f"blocks still held {freed_s:.1f} s after the cuts: {workers}"
    # promptly, by the cancellations: none of them was left to the lease's expiry
    expired = {key: w["expired_leases"] for key, w in workers.items()}
    assert not any(expired.values()), f"leases freed only by their expiry: {expired}"
    _, stats = server.get("/stats")
    assert stats["ingress"]["in_flight"] == 0, stats["ingress"]
    _valid_request_works(http)


def _answer(http: httpx.Client, path: str, body: bytes) -> tuple[int, Any]:
    resp = http.post(path, content=body, headers={"Content-Type": "application/json"})
    text = resp.text
    if resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream"):
        frames = [f for f in text.split("\n\n") if f]
        assert frames[-1] == "data: [DONE]", frames
        events = [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]
        assert all("error" not in e for e in events), events
        return 200, events
    try:
        return resp.status_code, json.loads(text)
    except json.JSONDecodeError:
        return resp.status_code, text  # check_error_body fails on a body that is not JSON


@pytest.mark.timeout(240)
def test_fuzz_over_http(server: ServeProcess, http: httpx.Client) -> None:
    @FUZZ
    @given(encoded(completion_bodies))
    def completions(body: bytes) -> None:
        check_error_body(*_answer(http, "/v1/completions", body))

    @FUZZ
    @given(encoded(chat_bodies))
    def chat(body: bytes) -> None:
        check_error_body(*_answer(http, "/v1/chat/completions", body))

    completions()
    chat()
    _valid_request_works(http)
    quiet, _, workers = wait_quiet(server, 20.0, leases=True, poll_s=0.1)
    assert quiet, f"blocks leaked by the fuzzed requests: {workers}"
