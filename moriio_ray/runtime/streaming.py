"""Turning a request's engine step outputs (an asyncio queue) into awaited results and chunks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from moriio_ray.engine.engine import StepOutput
from moriio_ray.errors import DeadlineExceeded, RequestCancelled
from moriio_ray.runtime.messages import TokenChunk

OutputQueue = asyncio.Queue[StepOutput | BaseException]


async def _next(q: OutputQueue, timeout_s: float, what: str) -> StepOutput:
    try:
        item = await asyncio.wait_for(q.get(), timeout_s)
    except asyncio.TimeoutError:
        raise DeadlineExceeded(f"the engine produced no {what} within {timeout_s} s") from None
    if isinstance(item, BaseException):
        raise item
    return item


async def wait_prefill(q: OutputQueue, timeout_s: float) -> tuple[StepOutput, float]:
    """The output that ends a request's prefill, and the seconds it took from now."""
    t0 = time.perf_counter()
    while True:
        out = await _next(q, timeout_s, "prefill output")
        if out.prefill is not None:
            return out, time.perf_counter() - t0
        if out.finished:
            raise RequestCancelled(f"request {out.request_id} ended before its prefill ({out.finish_reason})")


async def stream_outputs(
    q: OutputQueue, timeout_s: float, *, skip_first: bool = False
) -> AsyncIterator[TokenChunk]:
    """Chunks of new tokens until the request finishes; outputs already queued merge into one chunk."""
    to_skip = 1 if skip_first else 0
    while True:
        outs = [await _next(q, timeout_s, "token")]
        while not q.empty():
            item = q.get_nowait()
            if isinstance(item, BaseException):
                raise item
            outs.append(item)
        token_ids: list[int] = []
        logprobs: list[float] | None = None
        for out in outs:
            token_ids.extend(out.new_token_ids)
            if out.logprobs is not None:
                logprobs = [*(logprobs or []), *out.logprobs]
        if to_skip:
            dropped = min(to_skip, len(token_ids))
            token_ids = token_ids[dropped:]
            logprobs = logprobs[dropped:] if logprobs is not None else None
            to_skip -= dropped
        last = outs[-1]
        if token_ids or last.finished:
            yield TokenChunk(
                token_ids=token_ids,
                logprobs=logprobs,
                finished=last.finished,
                finish_reason=last.finish_reason,
            )
        if last.finished:
            return
