"""Property-based requests over /v1/completions and /v1/chat/completions, in process.

The front end (``OpenAIServer``) runs over the real ``PDPipeline.make_request`` (every bound) and a
real tiny engine that runs each admitted request for a few steps (sampling and stop checks on the
fuzzed parameters). Properties: no 5xx, every 4xx OpenAI-shaped, no stream carries an error, the
engine still serves a valid request afterwards, and no block is leaked. The same bodies go over
real HTTP in tests/e2e/test_hostile_http.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings

from moriio_ray.caller.pipeline import PDPipeline
from moriio_ray.caller.results import StreamEvent
from moriio_ray.config_load import parse_pipeline_config
from moriio_ray.engine.engine import Engine, StepOutput
from moriio_ray.protocol.messages import GenRequest, error_from
from moriio_ray.serve.handler import JSONReply, OpenAIServer, StreamReply
from moriio_ray.serve.prepare import Limits
from tests.fuzz_bodies import chat_bodies, check_error_body, completion_bodies, encoded

MAX_STEPS = 3  # engine steps per admitted request; then the stream ends as a client would close it
MAX_MODEL_LEN = 256
FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


class EnginePipeline:
    """The real ``make_request`` (a PDPipeline without a pool: only its checks run) and a stream
    that runs the request on one tiny colocated engine, for at most ``MAX_STEPS`` steps."""

    def __init__(self) -> None:
        cfg = parse_pipeline_config(
            {
                "name": "fuzz",
                "model": {"preset": "tiny", "seed": 0, "max_model_len": MAX_MODEL_LEN},
                "engine": {"device": "cpu", "num_blocks": 64, "block_size": 16},
                "pool": {"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "colocated": {"replicas": 1}},
            }
        )
        self.engine = Engine(cfg.model, cfg.engine, role="colocated", cuda_graphs=False)
        self.pipe = PDPipeline(coordinator=None, config=cfg)
        self.pipe.max_model_len = self.engine.max_model_len
        self.pipe.vocab_size = self.engine.args.vocab_size
        self.tokenizer = self.pipe.tokenizer
        self.num_served = 0
        self.pending: dict[str, list[StepOutput]] = {}  # request id -> its outputs not yet streamed

    def make_request(self, prompt: Any = None, **kw: Any) -> GenRequest:
        return self.pipe.make_request(prompt, **kw)

    async def stream_request(self, req: GenRequest, chunk_tokens: int = 1) -> AsyncIterator[StreamEvent]:
        # several streams share the engine (n > 1): whichever steps it hands each output to its
        # request's queue, so that no stream loses another one's tokens
        rid = req.request_id
        self.engine.add_request(rid, req.prompt_token_ids, req.params)
        self.pending[rid] = []
        n = 0
        try:
            for step in range(MAX_STEPS):
                if not self.pending[rid]:
                    for out in self.engine.step():
                        if out.request_id in self.pending:
                            self.pending[out.request_id].append(out)
                outs, self.pending[rid] = self.pending[rid], []
                for out in outs:
                    if out.error is not None:
                        raise error_from(*out.error)
                    n += len(out.new_token_ids)
                    last = out.finished or step == MAX_STEPS - 1
                    self.num_served += last
                    yield StreamEvent(
                        request_id=rid,
                        token_ids=out.new_token_ids,
                        text=self.tokenizer.decode(out.new_token_ids),
                        finished=last,
                        finish_reason=out.finish_reason or ("length" if last else None),
                        logprobs=out.logprobs,
                        num_prompt_tokens=len(req.prompt_token_ids),
                        num_output_tokens=n,
                    )
                    if last:
                        return
                await asyncio.sleep(0)  # let the other streams of the request run
        finally:
            self.pending.pop(rid, None)
            self.engine.abort(rid)

    async def stats_async(self) -> dict[str, Any]:
        return {"workers": {"colocated-0": self.engine.stats()}}


@pytest.fixture(scope="module")
def api() -> tuple[OpenAIServer, EnginePipeline]:
    pipe = EnginePipeline()

    async def live_roles() -> dict[str, int]:
        return {"colocated": 1}

    limits = Limits(model_name="tiny", max_model_len=MAX_MODEL_LEN, default_max_tokens=4)
    server = OpenAIServer(pipe, limits, max_ongoing_requests=4, request_timeout_s=30.0, live_roles=live_roles)
    return server, pipe


def _answer(server: OpenAIServer, path: str, body: bytes) -> tuple[int, Any]:
    async def go() -> tuple[int, Any]:
        reply = await server.handle("POST", path, body)
        if isinstance(reply, JSONReply):
            return reply.status, json.loads(reply.body)
        assert isinstance(reply, StreamReply)
        reply.begin()
        frames = [f async for f in reply.frames]
        await reply.close()
        assert frames[-1] == b"data: [DONE]\n\n", frames
        events = [json.loads(f[6:]) for f in frames[:-1]]
        assert all("error" not in e for e in events), events
        return 200, events

    return asyncio.run(go())


def _check_after(server: OpenAIServer, pipe: EnginePipeline) -> None:
    stats = pipe.engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert stats["num_running"] == stats["num_waiting"] == 0, stats
    assert server.admission.in_flight == 0
    status, body = _answer(server, "/v1/completions", b'{"prompt": "hello", "max_tokens": 2}')
    assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop"), body


@pytest.mark.timeout(120)
def test_fuzz_completions(api: tuple[OpenAIServer, EnginePipeline]) -> None:
    server, pipe = api

    @FUZZ
    @given(encoded(completion_bodies))
    @example(b'{"prompt": "a", "top_k": 9223372036854775808, "temperature": 1}')  # killed P
    @example(b'{"prompt": "a", "top_k": 18446744073709551616, "stream": true}')
    @example(b'{"prompt": "a", "top_k": 1000000000000000000000000000000, "temperature": 1}')
    @example(b'{"prompt": "a", "stop": ' + b"[" * 1000 + b"]" * 1000 + b"}")  # RecursionError
    @example(b'{"prompt": "0", "echo": false, "n": 2, "max_tokens": 2}')  # choices sharing the engine
    def one(body: bytes) -> None:
        check_error_body(*_answer(server, "/v1/completions", body))

    one()
    _check_after(server, pipe)
    assert pipe.num_served > 10, "too few fuzzed requests reached the engine"


@pytest.mark.timeout(120)
def test_fuzz_chat_completions(api: tuple[OpenAIServer, EnginePipeline]) -> None:
    server, pipe = api
    served_before = pipe.num_served

    @FUZZ
    @given(encoded(chat_bodies))
    @example(b'{"messages": [{"role": "user", "content": "a"}], "top_k": 9223372036854775808}')
    @example(b'{"messages": ' + b"[" * 1000 + b"]" * 1000 + b"}")
    @example(b'{"messages": [{"role": "system"}, {"role": "user"}], "n": 3}')
    def one(body: bytes) -> None:
        check_error_body(*_answer(server, "/v1/chat/completions", body))

    one()
    _check_after(server, pipe)
    assert pipe.num_served - served_before > 10, "too few fuzzed requests reached the engine"
