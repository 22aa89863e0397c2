"""Coalesced streaming (serve.stream_interval): what a streamed reply carries equals the same request
unstreamed, for any interval and any way the pipeline splits the output into events."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from moriio_ray.caller.detok import IncrementalText
from moriio_ray.caller.results import StreamEvent
from moriio_ray.engine.tokenizer import ByteTokenizer
from moriio_ray.errors import PeerLost
from moriio_ray.serve.handler import JSONReply, OpenAIServer, StreamReply
from moriio_ray.serve.prepare import Limits
from moriio_ray.serve.stream import merge

# multi-byte characters (held back until complete) and a stop string the splits cut through
OUTPUT = "héllo wörld, ∑ stop here ✓ and then the rest".encode()
INTERVALS = [1, 2, 3, 5, 1000]


@dataclass
class SplitPipeline:
    """A FAKE pipeline: streams OUTPUT in events of ``groups`` tokens, detokenized as the real one
    does (``IncrementalText``: stop strings, incomplete characters), one log probability per token.

    ``gate`` (when set) holds every event after the first until released; ``sent`` counts events."""

    groups: list[int]
    tokenizer: ByteTokenizer = field(default_factory=ByteTokenizer)
    gate: asyncio.Event | None = None
    fail_at: int | None = None  # raise PeerLost instead of the event of this index
    sent: int = 0
    closed: list[str] = field(default_factory=list)

    def make_request(
        self, prompt: Any = None, *, token_ids: Any = None, params: Any = None, request_id: Any = None
    ) -> Any:
        return (request_id, list(token_ids), params)

    async def stream_request(self, req: Any, chunk_tokens: int = 1) -> AsyncIterator[StreamEvent]:
        request_id, prompt_ids, params = req
        out = list(OUTPUT[: params.max_tokens])
        text = IncrementalText(self.tokenizer, params.stop)
        done, start = False, 0
        try:
            for size in self.groups:
                if self.sent and self.gate is not None:
                    await self.gate.wait()
                if self.sent == self.fail_at:
                    raise PeerLost("the decode worker died")
                ids, start = out[start : start + size], start + size
                final = start >= len(out)
                delta = text.add(ids, final=final)
                reason = "stop" if text.stopped and not final else "length" if final else None
                self.sent += 1
                yield StreamEvent(
                    request_id=request_id,
                    token_ids=ids,
                    text=delta,
                    finished=reason is not None,
                    finish_reason=reason,
                    logprobs=[-0.01 * t for t in ids] if params.logprobs else None,
                    num_prompt_tokens=len(prompt_ids),
                    num_output_tokens=start,
                )
                if reason is not None:
                    done = True
                    return
        finally:
            if not done:
                self.closed.append(request_id)

    async def stats_async(self) -> dict[str, Any]:
        return {}


def _split(n: int, rng: random.Random) -> list[int]:
    groups: list[int] = []
    while sum(groups) < n:
        groups.append(rng.choice([1, 1, 1, 2, 3, 7]))
    return groups


def _server(pipe: SplitPipeline, interval: int, timeout_s: float = 10.0) -> OpenAIServer:
    async def live_roles() -> dict[str, int]:
        return {"colocated": 1}

    limits = Limits(model_name="tiny", max_model_len=512, default_max_tokens=16)
    return OpenAIServer(
        pipe,
        limits,
        max_ongoing_requests=4,
        request_timeout_s=timeout_s,
        live_roles=live_roles,
        stream_interval=interval,
    )


async def _call(server: OpenAIServer, path: str, body: dict[str, Any]) -> Any:
    reply = await server.handle("POST", path, json.dumps(body).encode())
    if isinstance(reply, JSONReply):
        assert reply.status == 200, reply.body
        return json.loads(reply.body)
    assert isinstance(reply, StreamReply)
    frames = [f async for f in reply.frames]
    await reply.close()
    assert all(f.startswith(b"data: ") and f.endswith(b"\n\n") for f in frames)
    assert frames[-1] == b"data: [DONE]\n\n"
    return [json.loads(f[6:]) for f in frames[:-1]]


def _completion_body(stop: list[str]) -> dict[str, Any]:
    return {"prompt": "ab", "max_tokens": len(OUTPUT), "logprobs": 0, "stop": stop}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("stop", [[], ["stop"], ["∑ s", "nope"]], ids=["no-stop", "stop", "stop-multibyte"])
@pytest.mark.parametrize("seed", range(6))
def test_completion_stream_equals_the_whole_reply(stop: list[str], seed: int) -> None:
    rng = random.Random(seed)
    groups = [1] * len(OUTPUT) if seed == 0 else _split(len(OUTPUT), rng)

    async def go() -> None:
        whole = await _call(_server(SplitPipeline(groups), 1), "/v1/completions", _completion_body(stop))
        want = whole["choices"][0]
        for interval in INTERVALS:
            pipe = SplitPipeline(groups)
            body = {**_completion_body(stop), "stream": True, "stream_options": {"include_usage": True}}
            events = await _call(_server(pipe, interval), "/v1/completions", body)
            chunks = [e["choices"][0] for e in events if e["choices"]]
            assert "".join(c["text"] for c in chunks) == want["text"], interval
            for key in ("tokens", "token_logprobs", "text_offset"):
                got = [v for c in chunks for v in c["logprobs"][key]]
                assert got == want["logprobs"][key], (interval, key)
            assert [c["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
            assert chunks[-1]["finish_reason"] == want["finish_reason"]
            assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
            # the first event alone, then at least `interval` tokens per frame (the last may hold fewer)
            sizes = [len(c["logprobs"]["tokens"]) for c in chunks]
            assert sizes[0] == groups[0]
            assert all(s >= min(interval, len(OUTPUT)) for s in sizes[1:-1]), (interval, sizes)
            if interval == 1:
                assert len(chunks) == pipe.sent  # one frame per pipeline event, as before
            else:
                assert len(chunks) <= 2 + (sum(sizes) - sizes[0]) // interval, (interval, sizes)
        if stop:  # the stop string cut the output short, and none of it reached the client
            assert want["finish_reason"] == "stop" and stop[0] not in want["text"]
            assert whole["usage"]["completion_tokens"] < len(OUTPUT)
        else:
            assert want["finish_reason"] == "length" and want["text"] == OUTPUT.decode()

    asyncio.run(go())


@pytest.mark.timeout(20)
@pytest.mark.parametrize("seed", range(4))
def test_chat_stream_equals_the_whole_reply(seed: int) -> None:
    groups = _split(len(OUTPUT), random.Random(100 + seed))
    body = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "stop": ["stop"]}
    body["max_tokens"] = len(OUTPUT)

    async def go() -> None:
        whole = await _call(_server(SplitPipeline(groups), 1), "/v1/chat/completions", body)
        want = whole["choices"][0]
        assert want["finish_reason"] == "stop" and "stop" not in want["message"]["content"]
        for interval in INTERVALS:
            events = await _call(
                _server(SplitPipeline(groups), interval), "/v1/chat/completions", {**body, "stream": True}
            )
            assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            chunks = [e["choices"][0] for e in events[1:]]
            assert "".join(c["delta"].get("content", "") for c in chunks) == want["message"]["content"]
            got = [x for c in chunks for x in c["logprobs"]["content"]]
            assert got == want["logprobs"]["content"], interval
            assert chunks[-1]["finish_reason"] == "stop"

    asyncio.run(go())


@pytest.mark.timeout(10)
def test_stop_string_cut_across_events_never_reaches_the_client() -> None:
    # "stop" arrives one byte per event: the held-back tail is never sent, the text ends before it
    async def go() -> list[Any]:
        body = {**_completion_body(["stop"]), "stream": True}
        return await _call(_server(SplitPipeline([1] * len(OUTPUT)), 4), "/v1/completions", body)

    events = asyncio.run(go())
    text = "".join(e["choices"][0]["text"] for e in events)
    assert text == OUTPUT.decode().split("stop")[0]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.timeout(10)
def test_the_first_token_goes_at_once_and_a_close_while_coalescing_cancels() -> None:
    pipe = SplitPipeline([1] * len(OUTPUT), gate=asyncio.Event())
    server = _server(pipe, 8)

    async def go() -> None:
        reply = await server.handle("POST", "/v1/completions", json.dumps({"prompt": "ab", "stream": True}))
        assert isinstance(reply, StreamReply)
        # the gate holds every later event: the first frame cannot have waited for 8 tokens
        first = json.loads((await asyncio.wait_for(reply.frames.__anext__(), 5.0))[6:])
        assert first["choices"][0]["text"] == "h" and pipe.sent == 1
        waiting = asyncio.ensure_future(reply.frames.__anext__())  # blocks: the gate is shut
        await asyncio.sleep(0)
        assert not waiting.done()
        waiting.cancel()  # the client left while the ingress was gathering tokens
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await reply.close()

    asyncio.run(go())
    assert len(pipe.closed) == 1 and server.admission.in_flight == 0


@pytest.mark.timeout(10)
def test_a_failure_while_coalescing_first_sends_what_had_arrived() -> None:
    async def stream(interval: int) -> list[Any]:
        pipe = SplitPipeline([1] * len(OUTPUT), fail_at=11)
        return await _call(_server(pipe, interval), "/v1/completions", {"prompt": "ab", "stream": True})

    for interval in (4, 1000):
        got, want = asyncio.run(stream(interval)), asyncio.run(stream(1))
        assert "the decode worker died" in got[-1]["error"]["message"]
        text = ["".join(e["choices"][0]["text"] for e in events[:-1]) for events in (got, want)]
        assert text[0] == text[1] == OUTPUT[:11].decode(), interval  # no token lost to the gathering


@pytest.mark.timeout(10)
def test_a_deadline_passed_while_coalescing_is_an_error_event() -> None:
    pipe = SplitPipeline([1] * len(OUTPUT), gate=asyncio.Event())  # never released

    async def go() -> list[Any]:
        body = {"prompt": "ab", "stream": True}
        return await _call(_server(pipe, 4, timeout_s=0.2), "/v1/completions", body)

    events = asyncio.run(go())
    assert events[0]["choices"][0]["text"] == "h"
    assert "did not finish within 0.2 s" in events[-1]["error"]["message"]
    assert len(pipe.closed) == 1


@pytest.mark.timeout(10)
def test_merge_keeps_logprobs_only_when_every_token_has_one() -> None:
    def ev(ids: list[int], lps: list[float] | None, *, reason: str | None = None) -> StreamEvent:
        return StreamEvent(
            request_id="r",
            token_ids=ids,
            text="".join(map(chr, ids)),
            finished=reason is not None,
            finish_reason=reason,
            logprobs=lps,
            num_prompt_tokens=2,
            num_output_tokens=len(ids),
        )

    both = merge([ev([97], [-1.0]), ev([98, 99], [-2.0, -3.0], reason="length")])
    assert both.token_ids == [97, 98, 99] and both.text == "abc" and both.logprobs == [-1.0, -2.0, -3.0]
    assert both.finished and both.finish_reason == "length" and both.num_output_tokens == 2
    assert merge([ev([97], None), ev([98], None)]).logprobs is None
    assert merge([ev([97], [-1.0]), ev([98], None)]).logprobs is None
    assert merge([ev([], None)]).logprobs is None and merge([ev([], None)]).finish_reason is None
