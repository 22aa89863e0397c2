"""The OpenAI front end's request handling, independent of Ray Serve (tests drive it directly).

``OpenAIServer.handle(method, path, body)`` returns a ``JSONReply`` or a ``StreamReply``; the Serve
ingress (``app.py``) only turns those into HTTP responses. A generation request is validated and
tokenized first (400/404 for bad input), then admitted (429 beyond the bound), then its first
pipeline event is awaited before any status is sent, so that an unavailable pipeline is a 503 and
not a broken 200 stream. Closing a stream (or cancelling the task awaiting it) closes the pipeline
stream, which cancels the request on its workers and frees its KV blocks. A stream whose response
never starts (the client left right after the headers were due, and Serve dropped the response) is
closed by a timer ``STREAM_START_TIMEOUT_S`` later, never left to the garbage collector.

No failure escapes ``handle``: bad input is a 4xx naming the field, anything unexpected a generic
500 naming the request id, with the detail in the server log.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from moriio_ray.serve.admission import Admission, Slot
from moriio_ray.serve.choices import phases
from moriio_ray.serve.choices import sources as choice_sources
from moriio_ray.serve.errors import (
    APIError,
    bad_request,
    from_exception,
    internal_error,
    too_large,
    unavailable,
)
from moriio_ray.serve.openai import ChatCompletionRequest, CompletionRequest, parse_request
from moriio_ray.serve.prepare import Limits, Prepared, TokenizerLike, prepare_chat, prepare_completion
from moriio_ray.serve.responses import ChatFormat, CompletionFormat
from moriio_ray.serve.stream import Deadline, Format, Source, gather_all, sse_frames, whole_body
from moriio_ray.serve.tokenize import detokenize, tokenize

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20  # a larger body is a 413; 16 MiB holds any prompt a served model accepts
STREAM_START_TIMEOUT_S = 5.0  # a stream reply not started by then was dropped: cancel its request
HEALTH_TIMEOUT_S = 5.0
STATS_TIMEOUT_S = 15.0
WHOLE_REPLY = 1 << 30  # chunk_tokens of a reply sent whole: the pipeline wakes it at the end only


class PipelineLike(Protocol):
    """The part of ``PDPipeline`` the front end uses."""

    tokenizer: TokenizerLike

    def make_request(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        params: Any = None,
        request_id: str | None = None,
    ) -> Any: ...

    def stream_request(self, req: Any, chunk_tokens: int = 1) -> AsyncIterator[Any]: ...

    async def stats_async(self) -> dict[str, Any]: ...


IGNORED_HEADER = "X-Ignored-Fields"  # the unknown request fields ignored (serve.unknown_fields: ignore)


@dataclass
class JSONReply:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class StreamReply:
    """An SSE stream. ``begin`` says that its response starts (else the request is cancelled
    ``STREAM_START_TIMEOUT_S`` later); ``close`` must run however the response ends (idempotent)."""

    frames: AsyncIterator[bytes]
    close: Callable[[], Awaitable[None]]
    begin: Callable[[], None] = lambda: None
    headers: dict[str, str] = field(default_factory=dict)


Reply = JSONReply | StreamReply


def error_reply(err: APIError) -> JSONReply:
    return JSONReply(err.status, err.body())


class OpenAIServer:
    """Routes and serves the OpenAI endpoints over one pipeline."""

    def __init__(
        self,
        pipe: PipelineLike,
        limits: Limits,
        *,
        max_ongoing_requests: int,
        request_timeout_s: float,
        live_roles: Callable[[], Awaitable[dict[str, int]]],
        stream_interval: int = 1,
        unknown_fields: str = "ignore",
    ) -> None:
        self.pipe = pipe
        # n > 1 shares the prompt's prefill through the engines' prefix cache, when they have one
        engine = getattr(getattr(pipe, "config", None), "engine", None)
        self._shares_prefill = bool(getattr(engine, "enable_prefix_caching", False))
        self.limits = limits
        self.admission = Admission(max_ongoing_requests)
        self.request_timeout_s = request_timeout_s
        self.stream_interval = stream_interval  # tokens per SSE event (serve.stream_interval)
        self.unknown_fields = unknown_fields  # serve.unknown_fields: reject | ignore
        self.live_roles = live_roles
        self.started_unix = int(time.time())
        self._cleanups: set[asyncio.Future[None]] = set()  # closes of dropped streams, kept alive

    async def handle(self, method: str, path: str, body: bytes) -> Reply:
        """Serve one HTTP request; every failure becomes an OpenAI-shaped error reply."""
        try:
            return await self._route(method, path.rstrip("/") or "/", body)
        except APIError as err:
            return error_reply(err)
        except Exception as exc:  # a fault of ours: a generic 500, the detail in the log only
            rid = uuid.uuid4().hex
            log.error("internal error serving %s %s (request id %s)", method, path[:200], rid, exc_info=exc)
            return error_reply(internal_error(rid))

    async def _route(self, method: str, path: str, body: bytes) -> Reply:
        routes: dict[str, tuple[str, Callable[[bytes], Awaitable[Reply]]]] = {
            "/v1/completions": ("POST", self.completions),
            "/v1/chat/completions": ("POST", self.chat_completions),
            "/v1/models": ("GET", self.models),
            "/health": ("GET", self.health),
            "/stats": ("GET", self.stats),
            "/tokenize": ("POST", self.tokenize),
            "/detokenize": ("POST", self.detokenize),
        }
        if path not in routes:
            raise APIError(404, f"no route {path}; see /v1/models", code="not_found")
        want, fn = routes[path]
        if method != want:
            raise APIError(405, f"{path} takes {want}, not {method}", code="method_not_allowed")
        if len(body) > MAX_BODY_BYTES:
            raise too_large(len(body), MAX_BODY_BYTES)
        return await fn(body)

    # -- generation -----------------------------------------------------------------------------

    async def completions(self, body: bytes) -> Reply:
        ignored: list[str] = []
        req = parse_request(body, CompletionRequest, unknown_fields=self.unknown_fields, ignored=ignored)
        prompts = self._prepare(lambda: prepare_completion(req, self.pipe.tokenizer, self.limits))
        top = req.logprobs or 0
        fmt = CompletionFormat(
            self.limits.model_name, self.pipe.tokenizer.decode, logprobs=req.logprobs is not None, top=top
        )
        reply = await self._generate(prompts, fmt, stream=bool(req.stream), include_usage=req.include_usage)
        return _with_ignored(reply, ignored)

    async def chat_completions(self, body: bytes) -> Reply:
        ignored: list[str] = []
        req = parse_request(body, ChatCompletionRequest, unknown_fields=self.unknown_fields, ignored=ignored)
        prepared = self._prepare(lambda: [prepare_chat(req, self.pipe.tokenizer, self.limits)])
        top = req.top_logprobs or 0
        fmt = ChatFormat(
            self.limits.model_name, self.pipe.tokenizer.decode, logprobs=bool(req.logprobs), top=top
        )
        reply = await self._generate(prepared, fmt, stream=bool(req.stream), include_usage=req.include_usage)
        return _with_ignored(reply, ignored)

    def _prepare(self, fn: Callable[[], list[Prepared]]) -> list[Prepared]:
        try:
            return fn()
        except (UnicodeError, RecursionError, OverflowError) as exc:  # a tokenizer on odd input
            raise bad_request(
                f"the prompt cannot be tokenized ({type(exc).__name__})", code="invalid_prompt"
            ) from None
        except Exception as exc:
            raise from_exception(exc, validating=True) from None

    def _requests(self, prompts: list[Prepared], fmt: Format) -> list[tuple[Prepared, Any]]:
        """(its prompt, the pipeline request or None where nothing is generated) per choice, in
        choice order: ``n`` per prompt, each with its own sample stream."""
        count = sum(p.n for p in prompts)
        out: list[tuple[Prepared, Any]] = []
        for prepared in prompts:
            for j in range(prepared.n):
                if not prepared.generate:
                    out.append((prepared, None))
                    continue
                params = prepared.params
                if j and params.seed is not None:  # a seeded request's choices draw apart
                    params = msgspec.structs.replace(params, seed=(params.seed + j) % (1 << 64))
                rid = fmt.id if count == 1 else f"{fmt.id}-{len(out)}"
                try:
                    req = self.pipe.make_request(token_ids=prepared.token_ids, params=params, request_id=rid)
                except Exception as exc:
                    raise from_exception(exc, validating=True, fields=prepared.fields) from None
                out.append((prepared, req))
        return out

    async def _generate(
        self, prompts: list[Prepared], fmt: Format, *, stream: bool, include_usage: bool
    ) -> Reply:
        choices = self._requests(prompts, fmt)
        live = [req for _, req in choices if req is not None]
        if len(live) > self.admission.limit:  # it could never be admitted: not a 429 to retry
            raise bad_request(
                f"n: {len(live)} choices (prompts x n) are more than this server runs at once "
                f"({self.admission.limit}); ask for fewer",
                param="n",
            )
        slot = self.admission.acquire(max(1, len(live)))
        deadline = Deadline(self.request_timeout_s)
        opened: list[AsyncIterator[Any] | None] = [None] * len(live)
        firsts: list[Any] = [None] * len(live)
        try:
            for phase in phases(choices, self._shares_prefill):
                for i in phase:
                    # a stream sends stream_interval tokens an event, a body everything at the end:
                    # the pipeline wakes this replica no more often than that (its first token at once)
                    chunk = self.stream_interval if stream else WHOLE_REPLY
                    opened[i] = self.pipe.stream_request(live[i], chunk_tokens=chunk)
                got = await gather_all([deadline.next(opened[i]) for i in phase])  # type: ignore[arg-type]
                for i, first in zip(phase, got, strict=True):
                    firsts[i] = first
        except BaseException as exc:
            await _close([s for s in opened if s is not None], slot)
            if isinstance(exc, Exception):
                raise from_exception(exc, validating=False, request_id=fmt.id) from None
            raise
        streams = [s for s in opened if s is not None]
        sources = choice_sources(choices, firsts, streams)
        if stream:
            return self._stream_reply(fmt, sources, streams, deadline, include_usage, slot)
        try:
            return JSONReply(200, await whole_body(fmt, sources, deadline))
        except Exception as exc:
            raise from_exception(exc, validating=False, request_id=fmt.id) from None
        finally:
            await _close(streams, slot)

    def _stream_reply(
        self,
        fmt: Format,
        sources: list[Source],
        events: list[AsyncIterator[Any]],
        deadline: Deadline,
        include_usage: bool,
        slot: Slot,
    ) -> StreamReply:
        def abandon() -> None:
            # Serve dropped the response without starting it (its task was cancelled in between):
            # cancel the request now instead of when the garbage collector finds the stream.
            log.warning("stream %s was never started (the client left); cancelling it", fmt.id)
            task = asyncio.ensure_future(_close(events, slot, frames))
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)

        async def close() -> None:
            timer.cancel()
            await _close(events, slot, frames)

        async def sse() -> AsyncIterator[bytes]:
            timer.cancel()
            inner = sse_frames(
                fmt, sources, deadline, interval=self.stream_interval, include_usage=include_usage
            )
            try:
                async for frame in inner:
                    yield frame
            finally:
                await inner.aclose()  # type: ignore[attr-defined]
                await _close(events, slot)

        timer = asyncio.get_running_loop().call_later(STREAM_START_TIMEOUT_S, abandon)
        frames = sse()
        return StreamReply(frames=frames, close=close, begin=timer.cancel)

    # -- the rest -------------------------------------------------------------------------------

    async def tokenize(self, body: bytes) -> Reply:
        return JSONReply(200, self._tokenizing(lambda: tokenize(body, self.pipe.tokenizer, self.limits)))

    async def detokenize(self, body: bytes) -> Reply:
        return JSONReply(200, self._tokenizing(lambda: detokenize(body, self.pipe.tokenizer, self.limits)))

    def _tokenizing(self, fn: Callable[[], bytes]) -> bytes:
        try:
            return fn()
        except APIError:
            raise
        except Exception as exc:  # a tokenizer on odd input
            raise bad_request(f"the text cannot be (de)tokenized ({type(exc).__name__})") from None

    async def models(self, body: bytes) -> Reply:
        card = {
            "id": self.limits.model_name,
            "object": "model",
            "created": self.started_unix,
            "owned_by": "moriio-ray",
            "max_model_len": self.limits.max_model_len,
        }
        return JSONReply(200, msgspec.json.encode({"object": "list", "data": [card]}))

    async def health(self, body: bytes) -> Reply:
        """200 when the pool has live prefill and decode workers (or colocated ones), else 503."""
        try:
            roles = await asyncio.wait_for(self.live_roles(), HEALTH_TIMEOUT_S)
        except Exception as exc:
            raise unavailable(f"the pipeline's coordinator did not answer ({type(exc).__name__})") from None
        ok = roles.get("colocated", 0) > 0 or (roles.get("prefill", 0) > 0 and roles.get("decode", 0) > 0)
        if not ok:
            raise unavailable(f"the pool has no complete set of live workers: {roles}")
        return JSONReply(200, msgspec.json.encode({"status": "ok", "workers": roles}))

    async def stats(self, body: bytes) -> Reply:
        """The pipeline's per-worker counters plus this replica's admission counters."""
        try:
            stats = await asyncio.wait_for(self.pipe.stats_async(), STATS_TIMEOUT_S)
        except Exception as exc:
            raise unavailable(f"the pipeline's stats are unavailable ({type(exc).__name__})") from None
        stats["ingress"] = self.admission.stats()
        return JSONReply(200, msgspec.json.encode(stats))


async def _close(
    events: list[AsyncIterator[Any]], slot: Slot, frames: AsyncIterator[bytes] | None = None
) -> None:
    """Close the SSE frames, then the pipeline streams (cancelling the requests), then free the slot."""
    try:
        if frames is not None:
            await frames.aclose()  # type: ignore[attr-defined]
        for stream in events:
            await stream.aclose()  # type: ignore[attr-defined]
    finally:
        slot.release()


def _with_ignored(reply: Reply, ignored: list[str]) -> Reply:
    """The reply, naming the request's ignored unknown fields in a header (ASCII, bounded)."""
    if ignored:
        names = [n.encode("ascii", "backslashreplace").decode()[:64].replace(",", "_") for n in ignored[:32]]
        reply.headers[IGNORED_HEADER] = ", ".join(names)
    return reply
