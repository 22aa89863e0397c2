"""The worker's output streams: one per caller, carrying every ready output of that caller's requests.

A caller (a driver's PDPipeline, a Serve ingress replica) opens ``outputs(caller_id)`` once per
worker: a Ray streaming call whose every item is one msgpack ``OutputBatch`` holding all the
outputs that became ready for that caller since the last item, across requests and steps. So the
control plane costs one Ray object per (caller, worker) per engine step, never one per token per
request, and a slow caller gets fewer, larger items instead of a backlog.

A stream ends after ``period_s`` and the caller opens the next one at once; outputs produced in
between wait in the caller's box. That is also how a dead caller is noticed (Ray does not cancel an
actor's streaming call when its caller dies): a box with live requests and no open stream for
``CALLER_GRACE_S`` belongs to a caller that is gone, and its requests are aborted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec

from moriio_ray.protocol.messages import OutputBatch, RequestOutput

STREAM_PERIOD_S = 5.0  # one streaming call lasts this long, then the caller opens the next
CALLER_GRACE_S = 3 * STREAM_PERIOD_S  # no open stream for this long: the caller is gone

_encoder = msgspec.msgpack.Encoder()


@dataclass(eq=False)
class _Box:
    items: list[RequestOutput] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    num_open: int = 0
    last_seen_s: float = field(default_factory=time.monotonic)


class OutputHub:
    """Per-caller boxes of outputs (asyncio thread only)."""

    def __init__(self) -> None:
        self._boxes: dict[str, _Box] = {}

    def push(self, caller: str, item: RequestOutput) -> None:
        box = self._boxes.get(caller)
        if box is None:
            box = self._boxes[caller] = _Box()
        box.items.append(item)
        box.ready.set()

    async def stream(
        self, caller: str, period_s: float, on_cancel: Callable[[str], None]
    ) -> AsyncIterator[bytes]:
        """Items for ``caller`` for ``period_s``; a cancelled stream (the caller closed it) calls
        ``on_cancel(caller)``, which aborts the caller's requests."""
        box = self._boxes.get(caller)
        if box is None:
            box = self._boxes[caller] = _Box()
        box.num_open += 1
        loop = asyncio.get_running_loop()
        end_s = loop.time() + period_s
        timer = loop.call_at(end_s, box.ready.set)  # one timer per stream, not one per wait
        try:
            while True:
                if not box.items:
                    if loop.time() >= end_s:
                        return
                    box.ready.clear()
                    await box.ready.wait()
                    continue
                items, box.items = box.items, []
                yield _encoder.encode(OutputBatch(items))
        except (asyncio.CancelledError, GeneratorExit):
            on_cancel(caller)
            raise
        finally:
            timer.cancel()
            box.num_open -= 1
            box.last_seen_s = time.monotonic()

    def gone(self, live_callers: set[str], now_s: float | None = None) -> list[str]:
        """Callers with live requests but no stream open for ``CALLER_GRACE_S``; forgets boxes
        of callers that have neither requests nor streams."""
        now = time.monotonic() if now_s is None else now_s
        found = []
        for caller, box in list(self._boxes.items()):
            if box.num_open or now - box.last_seen_s < CALLER_GRACE_S:
                continue
            if caller in live_callers:
                found.append(caller)
            del self._boxes[caller]
        return found
