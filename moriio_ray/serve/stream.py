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
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from moriio_ray.serve.errors import ErrorBody, from_exception, unavailable
from moriio_ray.serve.responses import SSE_DONE, ChatFormat, CompletionFormat, sse, usage

log = logging.getLogger(__name__)

Format = CompletionFormat | ChatFormat


class EventLike(Protocol):
    """What the pipeline streams (``moriio_ray.runtime.results.StreamEvent``)."""

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


def merge(events: Sequence[EventLike]) -> Merged:
    """One event carrying everything ``events`` (consecutive, oldest first) carry."""
    last = events[-1]
    if len(events) == 1:
        ids, text, logprobs = list(last.token_ids), last.text, last.logprobs
    else:
        ids = [t for e in events for t in e.token_ids]
        text = "".join(e.text for e in events)
        values = [v for e in events for v in (e.logprobs or ())]
        has = any(e.logprobs is not None for e in events)
        logprobs = values if has and len(values) == len(ids) else None
    return Merged(
        token_ids=ids,
        text=text,
        logprobs=logprobs,
        finished=last.finished,
        finish_reason=last.finish_reason if last.finished else None,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        num_cached_tokens=last.num_cached_tokens,
    )


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


async def whole_body(fmt: Format, first: EventLike, events: AsyncIterator[Any], deadline: Deadline) -> bytes:
    """The JSON body of a request that does not stream."""
    pending = [first]
    while not pending[-1].finished:
        pending.append(await deadline.next(events))
    out = merge(pending)
    use = usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
    return fmt.whole(out.text, out.token_ids, out.logprobs, out.finish_reason, use)


async def sse_frames(
    fmt: Format,
    first: EventLike,
    events: AsyncIterator[Any],
    deadline: Deadline,
    *,
    interval: int,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """The SSE frames of a streamed request, ending ``data: [DONE]``.

    The status is already sent when this runs: a failure becomes an error event, then the end. The
    tokens gathered before it go out first, as one event each would have without coalescing.
    """
    pending: list[Any] = []
    try:
        if isinstance(fmt, ChatFormat):
            yield fmt.role_chunk()
        batch = merge([first])
        while True:
            yield fmt.chunk(batch.text, batch.token_ids, batch.logprobs, batch.finish_reason)
            pending = []
            if batch.finished:
                break
            batch = await next_batch(events, deadline, interval, pending)
        if include_usage:
            yield fmt.usage_chunk(
                usage(batch.num_prompt_tokens, batch.num_output_tokens, batch.num_cached_tokens)
            )
    except Exception as exc:
        if pending:
            part = merge(pending)
            yield fmt.chunk(part.text, part.token_ids, part.logprobs, None)
        err = from_exception(exc, validating=False, request_id=fmt.id)
        log.warning("stream %s failed: %s", fmt.id, err)
        yield sse(ErrorBody(error=err.info))
    yield SSE_DONE
