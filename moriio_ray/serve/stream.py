"""One request's pipeline events as the client receives them: coalesced SSE frames, or one body.

The pipeline hands the ingress one event per arrival of a request's tokens (every output that came
in since the last one, already merged). Sent one SSE frame each, at high concurrency almost every
token of every request becomes its own HTTP write, and on a Ray Serve proxy its own Ray streaming
item. ``sse_frames`` therefore merges consecutive events until ``stream_interval`` tokens are
pending (``serve.stream_interval``, as vLLM's and SGLang's option of that name), or the request
finished. The first event always goes out at once (the time to the first token does not change);
``stream_interval: 1`` sends one frame per event, as before.

Merging only concatenates what the events carry: text deltas (the detokenizer has already held back
incomplete characters and any tail that could still become a stop string, and cut the text at a
stop string), token ids and logprobs; the finish reason and the counts are the last event's. So the
concatenated frames of a stream equal the body of the same request unstreamed, for any interval.

A request with several choices (``n`` > 1, or a list of prompts) has one pipeline stream per
choice (a ``Source``); their frames interleave as they come, each naming its choice's index, and a
body holds every choice in index order. A choice may carry a prefix (``echo``) that goes in front
of its first frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from moriio_ray.serve.errors import ErrorBody, from_exception, unavailable
from moriio_ray.serve.responses import SSE_DONE, ChatFormat, CompletionFormat, Tops, Usage, sse, usage

log = logging.getLogger(__name__)
T = TypeVar("T")

Format = CompletionFormat | ChatFormat


class EventLike(Protocol):
    """What the pipeline streams (``moriio_ray.caller.results.StreamEvent``)."""

    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    logprobs: list[float] | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int


@dataclass
class Merged:
    """Consecutive events of one request as one."""

    token_ids: list[int]
    text: str
    logprobs: list[float] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    top_logprobs: list[Tops] | None = None


def merge(events: Sequence[EventLike]) -> Merged:
    """One event carrying everything ``events`` (consecutive, oldest first) carry."""
    last = events[-1]
    tops: list[Tops] | None
    if len(events) == 1:
        ids, text, logprobs = list(last.token_ids), last.text, last.logprobs
        tops = getattr(last, "top_logprobs", None)
    else:
        ids = [t for e in events for t in e.token_ids]
        text = "".join(e.text for e in events)
        values = [v for e in events for v in (e.logprobs or ())]
        has = any(e.logprobs is not None for e in events)
        logprobs = values if has and len(values) == len(ids) else None
        alternatives = [a for e in events for a in (getattr(e, "top_logprobs", None) or ())]
        tops = alternatives if len(alternatives) == len(ids) and ids else None
    return Merged(
        token_ids=ids,
        text=text,
        logprobs=logprobs,
        finished=last.finished,
        finish_reason=last.finish_reason if last.finished else None,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        num_cached_tokens=last.num_cached_tokens,
        top_logprobs=tops,
    )


@dataclass
class Source:
    """One choice's pipeline events: its first event (already awaited) and the rest (None: the first
    is its whole output). ``prefix`` (echo) goes in front of its first frame; ``counts_prompt``: its
    prompt counts in the usage (once per prompt, not once per choice)."""

    first: EventLike
    events: AsyncIterator[Any] | None
    prefix: Merged | None = None
    counts_prompt: bool = True
    pending: list[Any] = field(default_factory=list)  # events gathered for the next frame

    def opening(self) -> Merged:
        """The first frame's content: the prefix, then the first event."""
        return merge([e for e in (self.prefix, self.first) if e is not None])


class Deadline:
    """One request's overall deadline, applied to each wait for its next event.

    On Python 3.11+ a wait costs one timer handle (``asyncio.timeout_at``), not a task and a timer as
    ``asyncio.wait_for`` does: this runs once per engine step per request.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.end_s = asyncio.get_running_loop().time() + timeout_s

    async def next(self, events: AsyncIterator[Any]) -> Any:
        try:
            if sys.version_info >= (3, 11):
                async with asyncio.timeout_at(self.end_s):
                    return await events.__anext__()
            left_s = self.end_s - asyncio.get_running_loop().time()
            return await asyncio.wait_for(events.__anext__(), max(left_s, 0.0))
        except (asyncio.TimeoutError, TimeoutError):
            raise unavailable(f"the request did not finish within {self.timeout_s} s") from None
        except StopAsyncIteration:
            raise unavailable("the pipeline ended the stream without finishing the request") from None


async def next_batch(
    events: AsyncIterator[Any], deadline: Deadline, interval: int, pending: list[Any]
) -> Merged:
    """The next events merged: at least ``interval`` tokens, or up to the request's end. They gather
    in ``pending`` (the caller's), so that a failure midway can still send what had arrived."""
    pending.append(await deadline.next(events))
    count = len(pending[0].token_ids)
    while count < interval and not pending[-1].finished:
        pending.append(await deadline.next(events))
        count += len(pending[-1].token_ids)
    return merge(pending)


async def gather_all(awaitables: list[Awaitable[T]]) -> list[T]:
    """Every result, or the first failure with the others cancelled (and finished) before it
    propagates: a stream may be closed only once nothing awaits it."""
    if len(awaitables) == 1:
        return [await awaitables[0]]
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _usage(sources: list[Source], outs: list[Merged]) -> Usage:
    counted = [o for s, o in zip(sources, outs, strict=True) if s.counts_prompt]
    prompt, cached = sum(o.num_prompt_tokens for o in counted), sum(o.num_cached_tokens for o in counted)
    return usage(prompt, sum(o.num_output_tokens for o in outs), cached)


async def _drain(source: Source, deadline: Deadline) -> Merged:
    pending = [source.opening()]
    while not pending[-1].finished:
        assert source.events is not None  # a source without events starts finished
        pending.append(await deadline.next(source.events))
    return merge(pending)


async def whole_body(fmt: Format, sources: list[Source], deadline: Deadline) -> bytes:
    """The JSON body of a request that does not stream: every choice, in index order."""
    outs = await gather_all([_drain(s, deadline) for s in sources])
    choices = [
        fmt.whole_choice(i, o.text, o.token_ids, o.logprobs, o.finish_reason, o.top_logprobs)
        for i, o in enumerate(outs)
    ]
    return fmt.body(choices, _usage(sources, outs))


def _frame(fmt: Format, index: int, batch: Merged, finish_reason: str | None) -> bytes:
    return fmt.chunk(
        batch.text, batch.token_ids, batch.logprobs, finish_reason, index=index, tops=batch.top_logprobs
    )


async def _batches(
    sources: list[Source], deadline: Deadline, interval: int
) -> AsyncGenerator[tuple[int, Merged], None]:
    """(choice index, merged events) as they come: every choice's opening first, then each
    choice's next batch as soon as it is ready (one task per unfinished choice)."""
    last: dict[int, Merged] = {}
    for i, source in enumerate(sources):
        last[i] = source.opening()
        yield i, last[i]
    if len(sources) == 1:  # the common case, without tasks
        source, batch = sources[0], last[0]
        while not batch.finished:
            assert source.events is not None
            source.pending = []
            batch = await next_batch(source.events, deadline, interval, source.pending)
            yield 0, batch
        return
    tasks: dict[asyncio.Future[Merged], int] = {}

    def start(i: int) -> None:
        events = sources[i].events
        assert events is not None
        sources[i].pending = []
        tasks[asyncio.ensure_future(next_batch(events, deadline, interval, sources[i].pending))] = i

    for i, batch in last.items():
        if not batch.finished:
            start(i)
    try:
        while tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = tasks.pop(task)
                batch = task.result()
                yield i, batch
                if not batch.finished:
                    start(i)
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


async def sse_frames(
    fmt: Format,
    sources: list[Source],
    deadline: Deadline,
    *,
    interval: int,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The SSE frames of a streamed request, ending ``data: [DONE]``.

    The status is already sent when this runs: a failure becomes an error event, then the end. The
    tokens gathered before it go out first, as one event each would have without coalescing.
    """
    outs: dict[int, Merged] = {}
    try:
        if isinstance(fmt, ChatFormat):
            for i in range(len(sources)):
                yield fmt.role_chunk(i)
        async with contextlib.aclosing(_batches(sources, deadline, interval)) as batches:
            async for i, batch in batches:
                sources[i].pending = []
                yield _frame(fmt, i, batch, batch.finish_reason)
                outs[i] = batch
        if include_usage:
            yield fmt.usage_chunk(_usage(sources, [outs[i] for i in range(len(sources))]))
    except Exception as exc:
        for i, source in enumerate(sources):
            if source.pending:
                yield _frame(fmt, i, merge(source.pending), None)
        err = from_exception(exc, validating=False, request_id=fmt.id)
        log.warning("stream %s failed: %s", fmt.id, err)
        yield sse(ErrorBody(error=err.info))
    yield SSE_DONE
