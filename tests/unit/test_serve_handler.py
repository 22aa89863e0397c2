"""OpenAIServer end to end over a fake pipeline: bodies, SSE framing, errors, backpressure, cancellation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from moriio_ray.caller.pipeline import StreamEvent
from moriio_ray.caller.validate import check_request
from moriio_ray.engine.outputs import PromptLogprobs
from moriio_ray.engine.tokenizer import ByteTokenizer
from moriio_ray.errors import CapacityError, PeerLost
from moriio_ray.serve.handler import MAX_BODY_BYTES, JSONReply, OpenAIServer, Reply, StreamReply
from moriio_ray.serve.prepare import Limits


@dataclass
class FakePipeline:
    """A FAKE pipeline for unit tests: streams the prompt's bytes back one token per event.

    ``gate`` (when set) holds every event after the first until released, so that a test can act
    mid-stream; ``fail_first`` / ``fail_after`` raise instead of streaming. ``closed`` records the
    requests whose stream was closed before finishing (what cancels a request in the real pipeline).
    """

    tokenizer: ByteTokenizer = field(default_factory=ByteTokenizer)
    gate: asyncio.Event | None = None
    fail_first: Exception | None = None
    fail_after: Exception | None = None
    closed: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    max_model_len: int = 64  # as the servers below are told (their Limits)

    def make_request(
        self, prompt: Any = None, *, token_ids: Any = None, params: Any = None, request_id: Any = None
    ):
        # the real pipeline's one check against the model (PDPipeline.make_request runs the same)
        ids = list(token_ids)
        check_request(ids, params, vocab_size=self.tokenizer.vocab_size, max_model_len=self.max_model_len)
        return (request_id, ids, params)

    async def stream_request(self, req: Any, chunk_tokens: int = 1) -> AsyncIterator[StreamEvent]:
        request_id, ids, params = req
        out = ids[: params.max_tokens]
        done = False
        try:
            if self.fail_first is not None:
                raise self.fail_first
            for i, token in enumerate(out):
                if i > 0 and self.gate is not None:
                    await self.gate.wait()
                if i > 0 and self.fail_after is not None:
                    raise self.fail_after
                last = i == len(out) - 1
                done = last
                yield StreamEvent(
                    request_id=request_id,
                    token_ids=[token],
                    text=bytes([token]).decode(),
                    finished=last,
                    finish_reason="length" if last else None,
                    logprobs=[-0.5] if params.logprobs else None,
                    top_logprobs=[_alternatives(token, params.top_logprobs)] if params.top_logprobs else None,
                    prompt_logprobs=_prompt_logprobs(ids, params.prompt_logprobs) if i == 0 else None,
                    num_prompt_tokens=len(ids),
                    num_output_tokens=i + 1,
                    num_cached_tokens=len(ids) // 2,  # as if a prefix cache held half the prompt
                )
        finally:
            (self.finished if done else self.closed).append(request_id)

    async def stats_async(self) -> dict[str, Any]:
        return {"workers": {"p": {"num_free_blocks": 7}}}


def _alternatives(token: int, count: int) -> list[tuple[int, float]]:
    """The FAKE's alternatives: the token itself first, then the next ids, less and less likely."""
    return [((token + k) % 256, -0.5 - k) for k in range(count)]


def _prompt_logprobs(ids: list[int], count: int | None) -> PromptLogprobs | None:
    """The FAKE's prompt logprobs: null for the first token, -0.5 for the others."""
    if count is None:
        return None
    return PromptLogprobs([None] + [-0.5] * (len(ids) - 1), [[]] + [_alternatives(t, count) for t in ids[1:]])


def _server(
    pipe: FakePipeline, *, limit: int = 8, roles: dict[str, int] | None = None, **options: Any
) -> OpenAIServer:
    async def live_roles() -> dict[str, int]:
        if roles is None:
            raise ConnectionError("coordinator gone")
        return roles

    limits = Limits(model_name="tiny", max_model_len=64, default_max_tokens=16)
    return OpenAIServer(
        pipe, limits, max_ongoing_requests=limit, request_timeout_s=10.0, live_roles=live_roles, **options
    )


def _run(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(coro_fn())


async def _post(server: OpenAIServer, path: str, body: dict[str, Any]) -> Reply:
    return await server.handle("POST", path, json.dumps(body).encode())


async def _drain(reply: Reply) -> list[bytes]:
    assert isinstance(reply, StreamReply)
    frames = [f async for f in reply.frames]
    await reply.close()
    return frames


def _events(frames: list[bytes]) -> list[Any]:
    assert all(f.startswith(b"data: ") and f.endswith(b"\n\n") for f in frames)
    assert frames[-1] == b"data: [DONE]\n\n"
    return [json.loads(f[6:]) for f in frames[:-1]]


def _json(reply: Reply) -> tuple[int, Any]:
    assert isinstance(reply, JSONReply)
    return reply.status, json.loads(reply.body)


@pytest.mark.timeout(10)
def test_completion_whole() -> None:
    pipe = FakePipeline()
    status, body = _json(
        _run(lambda: _post(_server(pipe), "/v1/completions", {"prompt": "hey", "logprobs": 0}))
    )
    assert status == 200
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == "tiny"
    assert isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["text"] == "hey" and choice["finish_reason"] == "length" and choice["index"] == 0
    assert choice["logprobs"]["tokens"] == ["h", "e", "y"] and choice["logprobs"]["text_offset"] == [0, 1, 2]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    assert pipe.finished == [body["id"]] and not pipe.closed


@pytest.mark.timeout(10)
def test_completion_stream_with_usage() -> None:
    pipe = FakePipeline()
    body = {"prompt": "abc", "stream": True, "stream_options": {"include_usage": True}}

    async def go() -> list[bytes]:
        return await _drain(await _post(_server(pipe), "/v1/completions", body))

    events = _events(_run(go))
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert texts == ["a", "b", "c"]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]] == [None, None, "length"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 6
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}
    assert len({e["id"] for e in events}) == 1 and events[0]["object"] == "text_completion"


@pytest.mark.timeout(10)
def test_chat_whole_and_stream() -> None:
    pipe = FakePipeline()
    msgs = [{"role": "user", "content": "yo"}]
    status, body = _json(
        _run(lambda: _post(_server(pipe), "/v1/chat/completions", {"messages": msgs, "max_tokens": 40}))
    )
    assert status == 200 and body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "user: yo\nassistant:",
        "refusal": None,
    }

    async def go() -> list[bytes]:
        reply = await _post(
            _server(pipe),
            "/v1/chat/completions",
            {"messages": msgs, "stream": True, "logprobs": True, "max_tokens": 40},
        )
        return await _drain(reply)

    events = _events(_run(go))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:])
    assert text == "user: yo\nassistant:"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[1]["choices"][0]["logprobs"]["content"][0] == {
        "token": "u",
        "logprob": -0.5,
        "bytes": [117],
        "top_logprobs": [],
    }
    assert "usage" not in events[-1] or events[-1]["usage"] is None


@pytest.mark.timeout(10)
def test_closing_a_stream_midway_cancels_the_request_and_frees_the_slot() -> None:
    pipe = FakePipeline(gate=asyncio.Event())
    server = _server(pipe)

    async def go() -> None:
        reply = await _post(server, "/v1/completions", {"prompt": "abcdef", "stream": True})
        assert isinstance(reply, StreamReply)
        first = await reply.frames.__anext__()
        assert json.loads(first[6:])["choices"][0]["text"] == "a"
        assert server.admission.in_flight == 1
        await reply.close()  # what the ingress does when the client goes away

    _run(go)
    assert len(pipe.closed) == 1 and not pipe.finished
    assert server.admission.in_flight == 0


@pytest.mark.timeout(10)
def test_a_stream_never_started_still_closes() -> None:
    pipe = FakePipeline()
    server = _server(pipe)

    async def go() -> None:
        reply = await _post(server, "/v1/completions", {"prompt": "abcdef", "stream": True})
        assert isinstance(reply, StreamReply)
        await reply.close()

    _run(go)
    assert len(pipe.closed) == 1 and server.admission.in_flight == 0


@pytest.mark.timeout(10)
def test_backpressure_429_then_recovers() -> None:
    pipe = FakePipeline(gate=asyncio.Event())
    server = _server(pipe, limit=1)

    async def go() -> None:
        held = await _post(server, "/v1/completions", {"prompt": "abc", "stream": True})
        status, body = _json(await _post(server, "/v1/completions", {"prompt": "abc"}))
        assert status == 429 and body["error"]["type"] == "rate_limit_error"
        assert server.admission.rejected == 1
        assert isinstance(held, StreamReply)
        await held.close()
        assert pipe.gate is not None
        pipe.gate.set()
        status, _ = _json(await _post(server, "/v1/completions", {"prompt": "abc"}))
        assert status == 200

    _run(go)


@pytest.mark.timeout(10)
def test_pipeline_failures_before_the_first_token_are_503() -> None:
    for exc in (CapacityError("no live prefill worker"), PeerLost("gone"), asyncio.TimeoutError()):
        server = _server(FakePipeline(fail_first=exc))
        status, body = _json(_run(lambda s=server: _post(s, "/v1/completions", {"prompt": "abc"})))
        assert status == 503 and body["error"]["type"] == "server_error", body
        assert server.admission.in_flight == 0


@pytest.mark.timeout(10)
def test_failure_mid_stream_is_an_error_event_then_done() -> None:
    pipe = FakePipeline(fail_after=PeerLost("decode worker died"))
    server = _server(pipe)

    async def go() -> list[bytes]:
        return await _drain(await _post(server, "/v1/completions", {"prompt": "abc", "stream": True}))

    events = _events(_run(go))
    assert events[0]["choices"][0]["text"] == "a"
    assert "decode worker died" in events[-1]["error"]["message"]
    assert server.admission.in_flight == 0


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("POST", "/v1/completions", b"{oops", 400),
        ("POST", "/v1/completions", b'{"prompt": 3}', 400),
        ("POST", "/v1/completions", b'{"prompt": "a", "max_tokens": 0}', 400),
        ("POST", "/v1/completions", b'{"prompt": "a", "model": "other"}', 404),
        ("POST", "/v1/completions", b'{"prompt": "a", "kv_transfer_params": {}}', 400),
        ("POST", "/v1/completions", ('{"prompt": "' + "x" * 80 + '"}').encode(), 400),
        ("POST", "/v1/completions", b" " * (MAX_BODY_BYTES + 1), 413),
        ("POST", "/v1/nothing", b"{}", 404),
        ("GET", "/v1/completions", b"", 405),
    ],
)
def test_errors_are_openai_shaped(method: str, path: str, body: bytes, status: int) -> None:
    pipe = FakePipeline()
    got, payload = _json(_run(lambda: _server(pipe).handle(method, path, body)))
    assert got == status
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert not pipe.closed and not pipe.finished  # nothing reached the pipeline


@pytest.mark.timeout(10)
def test_models_health_stats() -> None:
    pipe = FakePipeline()
    status, body = _json(_run(lambda: _server(pipe).handle("GET", "/v1/models", b"")))
    assert status == 200 and body["data"][0]["id"] == "tiny" and body["object"] == "list"
    for roles, want in (
        ({"prefill": 1, "decode": 1}, 200),
        ({"colocated": 2}, 200),
        ({"prefill": 1}, 503),
        ({}, 503),
        (None, 503),
    ):
        status, _ = _json(_run(lambda r=roles: _server(pipe, roles=r).handle("GET", "/health", b"")))
        assert status == want, roles
    status, body = _json(_run(lambda: _server(pipe).handle("GET", "/stats/", b"")))
    assert status == 200 and body["workers"]["p"]["num_free_blocks"] == 7
    assert body["ingress"] == {"limit": 8, "in_flight": 0, "admitted": 0, "rejected": 0}


@dataclass
class CachingPipeline(FakePipeline):
    """The FAKE with a prefix cache in its config; ``log`` records when each request starts and
    when its first event comes out."""

    log: list[tuple[str, str]] = field(default_factory=list)
    config: Any = field(
        default_factory=lambda: SimpleNamespace(engine=SimpleNamespace(enable_prefix_caching=True))
    )

    async def stream_request(self, req: Any, chunk_tokens: int = 1) -> AsyncIterator[StreamEvent]:
        self.log.append(("start", req[0]))
        await asyncio.sleep(0.01)  # a prefill takes a while: requests started together overlap
        first = True
        async for event in super().stream_request(req):
            if first:
                self.log.append(("first", req[0]))
                first = False
            yield event


@pytest.mark.timeout(10)
@pytest.mark.parametrize("caching", [True, False])
def test_n_choices_start_after_the_first_ones_prefill_with_a_prefix_cache(caching: bool) -> None:
    pipe = CachingPipeline()
    pipe.config.engine.enable_prefix_caching = caching
    body = {"prompt": ["ab", "cd"], "n": 3, "max_tokens": 2, "temperature": 1.0}
    status, out = _json(_run(lambda: _post(_server(pipe), "/v1/completions", body)))
    assert status == 200 and [c["index"] for c in out["choices"]] == list(range(6))
    starts = [rid for kind, rid in pipe.log if kind == "start"]
    firsts = [rid for kind, rid in pipe.log if kind == "first"]
    leaders = {starts[0], starts[1]}  # one choice per prompt
    if caching:  # the others start only once both leaders' first tokens (their prefills) are out
        later = pipe.log.index(("start", starts[2]))
        assert {rid for kind, rid in pipe.log[:later] if kind == "first"} == leaders
    else:  # every choice at once
        assert pipe.log.index(("first", firsts[0])) == len(starts)
    assert len(starts) == 6 and len(set(starts)) == 6
