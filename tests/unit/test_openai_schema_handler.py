"""Every reply of OpenAIServer, over a fake pipeline, validates against OpenAI's published schemas.

The same kinds go over HTTP to a real ``serve run`` in tests/e2e/test_openai_schema_http.py; this
module adds the errors that need a server state the real one does not reach cheaply (429, 503, 500,
a failure mid-stream), and fails in seconds where the e2e one takes a server start.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from moriio_ray.errors import PeerLost
from moriio_ray.serve.handler import JSONReply, OpenAIServer, Reply, StreamReply
from moriio_ray.serve.prepare import Limits
from tests.openai_replies import (
    COMPLETIONS,
    ERRORS,
    KINDS,
    ErrorCase,
    Kind,
    check_error,
    check_reply,
    check_valid,
    sse_bodies,
)
from tests.openai_spec import COMPLETION_CHUNK
from tests.unit.test_serve_handler import FakePipeline


def _server(pipe: FakePipeline, *, limit: int = 8) -> OpenAIServer:
    async def live_roles() -> dict[str, int]:
        return {"prefill": 1, "decode": 1}

    limits = Limits(model_name="tiny", max_model_len=64, default_max_tokens=16)
    return OpenAIServer(
        pipe, limits, max_ongoing_requests=limit, request_timeout_s=10.0, live_roles=live_roles
    )


async def _content(reply: Reply) -> tuple[int, bytes]:
    """(status, body) as the client gets them: a stream's frames joined, as HTTP carries them."""
    if isinstance(reply, JSONReply):
        return reply.status, reply.body
    try:
        return 200, b"".join([frame async for frame in reply.frames])
    finally:
        await reply.close()


def _ask(pipe: FakePipeline, method: str, path: str, body: bytes) -> tuple[int, bytes]:
    async def go() -> tuple[int, bytes]:
        return await _content(await _server(pipe).handle(method, path, body))

    return asyncio.run(go())


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_reply_validates(kind: Kind) -> None:
    check_reply(kind, *_ask(FakePipeline(), kind.method, kind.path, kind.body))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("case", ERRORS, ids=[c.name for c in ERRORS])
def test_error_validates(case: ErrorCase) -> None:
    check_error(case, *_ask(FakePipeline(), case.method, case.path, case.body))


PROMPT = json.dumps({"prompt": "abc"}).encode()
STREAM = json.dumps({"prompt": "abc", "stream": True}).encode()


@pytest.mark.timeout(10)
def test_429_503_and_500_validate() -> None:
    err429 = ErrorCase("busy", 429, "POST", COMPLETIONS, PROMPT)

    async def busy() -> tuple[int, bytes]:
        server = _server(FakePipeline(gate=asyncio.Event()), limit=1)
        held = await server.handle("POST", COMPLETIONS, STREAM)
        try:
            return await _content(await server.handle("POST", COMPLETIONS, PROMPT))
        finally:
            assert isinstance(held, StreamReply)
            await held.close()

    check_error(err429, *asyncio.run(busy()))
    err503 = ErrorCase("no worker", 503, "POST", COMPLETIONS, PROMPT)
    check_error(err503, *_ask(FakePipeline(fail_first=PeerLost("gone")), "POST", COMPLETIONS, PROMPT))
    err500 = ErrorCase("a fault of the server", 500, "POST", COMPLETIONS, PROMPT)
    check_error(err500, *_ask(FakePipeline(fail_first=KeyError("bug")), "POST", COMPLETIONS, PROMPT))


@pytest.mark.timeout(10)
def test_an_error_mid_stream_validates() -> None:
    pipe = FakePipeline(fail_after=PeerLost("decode worker died"))
    status, content = _ask(pipe, "POST", COMPLETIONS, STREAM)
    assert status == 200
    *chunks, error = sse_bodies(content)
    assert chunks, content
    for i, chunk in enumerate(chunks):
        check_valid(COMPLETION_CHUNK, chunk, f"chunk {i}")
    check_valid("ErrorResponse", error, "the error event")
