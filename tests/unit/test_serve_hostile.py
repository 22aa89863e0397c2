"""Hostile input at the HTTP layer: no 5xx for bad input, no internals in any body, and a stream
whose response never starts still cancels its request (OpenAIServer over the fake pipeline)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest
from ray.exceptions import RayTaskError
from test_serve_handler import FakePipeline, _json, _post, _run, _server

from moriio_ray.errors import EngineFailed, InvalidRequest, RequestFailed
from moriio_ray.serve import handler
from moriio_ray.serve.errors import public_text
from moriio_ray.serve.handler import StreamReply

A = {"prompt": "a"}


def _ray_error(cause: Exception) -> Exception:
    """``cause`` as Ray re-raises it in the caller: its text is the remote traceback."""
    try:
        raise cause
    except Exception as exc:
        trace = (
            "\x1b[36mray::EngineWorker.prefill()\x1b[39m (pid=4242, ip=10.0.0.7, actor_id=abcdef)\n"
            'Traceback (most recent call last):\n  File "/opt/venv/lib/python3.11/site-packages/x.py", '
            f"line 9, in prefill\n{type(exc).__name__}: {exc}"
        )
        return RayTaskError("prefill", trace, exc, proctitle="ray::EngineWorker").as_instanceof_cause()


def _assert_clean(body: dict[str, Any]) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    text = json.dumps(body)
    for leak in ("Traceback", "\\u001b", "/opt/", "site-packages", "pid=", "actor_id", "ray::"):
        assert leak not in text, (leak, text)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("depth", [1_000, 5_000, 100_000])
def test_deep_nesting_is_a_400(depth: int) -> None:
    server = _server(FakePipeline())
    for body in (
        b"[" * depth + b"]" * depth,
        b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}",
        b'{"prompt": "a", "stop": ' + b'{"a":' * depth + b"1" + b"}" * depth + b"}",
    ):
        status, payload = _json(_run(lambda b=body: server.handle("POST", "/v1/completions", b)))
        assert status == 400 and payload["error"]["code"] == "invalid_json", payload
        _assert_clean(payload)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_k": 9223372036854775808, "temperature": 1.0}, "top_k"),  # the engine killer
        ({"top_k": 2**64}, "top_k"),
        ({"top_k": 10**30}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"temperature": 1e308, "top_p": 0.5}, "temperature"),
        ({"stop": ["x"] * 33}, "stop"),
        ({"stop": "x" * 513}, "stop"),
        ({"stop_token_ids": [1] * 1025}, "stop_token_ids"),
        ({"stop_token_ids": [2**70]}, "stop_token_ids"),
        ({"n": 10**30}, "n"),
    ],
)
def test_out_of_range_fields_are_400s_naming_them(fields: dict[str, Any], param: str) -> None:
    pipe = FakePipeline()
    status, body = _json(_run(lambda: _post(_server(pipe), "/v1/completions", {**A, **fields})))
    assert status == 400 and body["error"]["param"] == param, body
    assert len(body["error"]["message"]) < 300
    assert not pipe.closed and not pipe.finished


@pytest.mark.timeout(10)
def test_a_huge_number_in_the_body_is_a_400() -> None:
    server = _server(FakePipeline())
    status, body = _json(
        _run(lambda: server.handle("POST", "/v1/completions", b'{"prompt": "a", "top_p": 1e999}'))
    )
    assert status == 400 and body["error"]["code"] == "invalid_json"


@pytest.mark.timeout(10)
def test_an_internal_error_is_a_generic_500_with_the_detail_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = RuntimeError("boom at /srv/app/secret.py line 3")
    pipe = FakePipeline(fail_first=_ray_error(secret))
    with caplog.at_level(logging.ERROR, logger="moriio_ray.serve"):
        status, body = _json(_run(lambda: _post(_server(pipe), "/v1/completions", A)))
    assert status == 500 and body["error"]["type"] == "server_error"
    assert body["error"]["code"] == "internal_error"
    _assert_clean(body)
    assert "secret" not in json.dumps(body)
    request_id = body["error"]["message"].split("request id ")[1].split(")")[0]
    assert request_id.startswith("cmpl-")
    logged = "\n".join(r.getMessage() + str(r.exc_info) for r in caplog.records)
    assert request_id in logged and "boom at /srv/app/secret.py" in logged


@pytest.mark.timeout(10)
def test_a_fault_outside_the_request_path_is_a_generic_500(caplog: pytest.LogCaptureFixture) -> None:
    pipe = FakePipeline()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("/internal/state")

    pipe.make_request = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="moriio_ray.serve"):
        status, body = _json(_run(lambda: _post(_server(pipe), "/v1/completions", A)))
    assert status == 500 and "/internal/state" not in json.dumps(body)
    _assert_clean(body)
    assert any("/internal/state" in str(r.exc_info) for r in caplog.records)


@pytest.mark.timeout(10)
def test_typed_errors_from_workers_show_their_cause_only() -> None:
    for cause, status in (
        (InvalidRequest("top_k: 300 must be at most the vocabulary size 260"), 400),
        (EngineFailed("the engine of p-0 failed (RuntimeError); retry the request"), 503),
        (RequestFailed("request r failed in the engine (ValueError ...)"), 500),
    ):
        pipe = FakePipeline(fail_first=_ray_error(cause))
        got, body = _json(_run(lambda p=pipe: _post(_server(p), "/v1/completions", A)))
        assert got == status, body
        _assert_clean(body)
        if status != 500:
            assert str(cause) in body["error"]["message"]
    assert public_text(_ray_error(ValueError("x\ny"))) == "x"


@pytest.mark.timeout(10)
def test_a_stream_reply_that_is_never_started_cancels_its_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve cancelled the request task after the handler answered and before the response ran:
    the reply is dropped unstarted, and something (a traceback) may keep it from being collected."""
    monkeypatch.setattr(handler, "STREAM_START_TIMEOUT_S", 0.2)
    pipe = FakePipeline(gate=asyncio.Event())
    server = _server(pipe)
    kept: list[Any] = []

    async def go() -> float:
        reply = await _post(server, "/v1/completions", {"prompt": "abcdef", "stream": True})
        assert isinstance(reply, StreamReply) and server.admission.in_flight == 1
        kept.append(reply)  # never started, never closed, never collected
        t0 = time.monotonic()
        while not pipe.closed and time.monotonic() - t0 < 5.0:
            await asyncio.sleep(0.02)
        return time.monotonic() - t0

    waited_s = _run(go)
    assert len(pipe.closed) == 1, "the dropped stream's request was never cancelled"
    assert waited_s < 2.0 and server.admission.in_flight == 0


@pytest.mark.timeout(10)
def test_a_started_stream_is_not_cancelled_by_the_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handler, "STREAM_START_TIMEOUT_S", 0.05)
    pipe = FakePipeline()
    server = _server(pipe)

    async def go() -> list[bytes]:
        reply = await _post(server, "/v1/completions", {"prompt": "abcdef", "stream": True})
        assert isinstance(reply, StreamReply)
        reply.begin()
        await asyncio.sleep(0.2)  # well past the timer: a started response must not be cut
        frames = [f async for f in reply.frames]
        await reply.close()
        return frames

    frames = _run(go)
    assert len(frames) == 7 and pipe.finished and not pipe.closed  # 6 tokens + [DONE]
