"""The caller's end of the workers' output streams: one pump per worker, demultiplexed by request.

Each worker sends this caller one msgpack ``OutputBatch`` per engine step (or fewer, larger ones
when this caller falls behind), holding the outputs of all this caller's requests on it. The pump
reads that stream and files each output under its request's ``Subscription``. A worker that dies
fails every subscription on it with Ray's ``RayActorError``, which the flows turn into a retry, a
continuation or ``PeerLost``.

One ``OutputStreams`` serves one asyncio loop (its pumps and queues belong to it).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import msgspec
import ray

from moriio_ray.errors import DeadlineExceeded
from moriio_ray.protocol.messages import Member, OutputBatch, RequestOutput

log = logging.getLogger(__name__)

_decoder = msgspec.msgpack.Decoder(OutputBatch)
WATCH_PERIOD_S = 0.25  # how often waits are checked against their deadline (its resolution)


class Subscription:
    """One request's outputs from one worker (filled by the pump, drained by the flow).

    A wait may ask for a chunk of several tokens (``next(..., chunk_tokens=k)``): the pump then
    wakes it once k tokens are pending or the request ended or failed, not for each engine step.
    A consumer that sends k tokens at a time (an SSE stream at ``serve.stream_interval``, a whole
    reply) so wakes once per k tokens instead of once per token.
    """

    def __init__(self, pump: _Pump, request_id: str) -> None:
        self._pump = pump
        self.request_id = request_id
        self._items: list[RequestOutput] = []
        self._num_tokens = 0  # in _items
        self._wake_at = 1  # tokens pending that end the current wait
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.deadline_s = 0.0  # loop time by which a pending wait ends

    def expire_if_late(self, now_s: float) -> None:
        if self._waiter is not None and now_s >= self.deadline_s:
            self._wake()

    def put(self, item: RequestOutput) -> None:
        self._items.append(item)
        self._num_tokens += len(item.token_ids)
        if item.finished or self._num_tokens >= self._wake_at:
            self._wake()

    def fail(self, exc: BaseException) -> None:
        self._error = exc
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self, timeout_s: float, chunk_tokens: int = 1) -> list[RequestOutput]:
        """Every output that has arrived: at least ``chunk_tokens`` tokens' worth, or the outputs
        up to the request's end (or its error); waits up to ``timeout_s``, and then returns what
        has arrived, if anything."""
        if self._num_tokens < chunk_tokens and not self._ends() and self._error is None:
            loop = asyncio.get_running_loop()
            self._wake_at = chunk_tokens
            self._waiter = waiter = loop.create_future()
            # the streams' watchdog ends a wait past its deadline (no timer per wait: this is per chunk)
            self.deadline_s = loop.time() + timeout_s
            self._pump.streams.watch()
            try:
                await waiter
            finally:
                self._waiter = None
        if self._items:
            items, self._items, self._num_tokens = self._items, [], 0
            return items
        if self._error is not None:
            raise self._error
        raise DeadlineExceeded(
            f"no output of {self.request_id} from {self._pump.member.key} within {timeout_s} s"
        )

    def _ends(self) -> bool:
        """The request's last output (its end or its error) is pending: nothing more will come."""
        return bool(self._items) and self._items[-1].finished

    def close(self) -> None:
        self._pump.subs.pop(self.request_id, None)


class _Pump:
    """Reads one worker's stream for this caller and files its outputs."""

    def __init__(self, streams: OutputStreams, member: Member) -> None:
        self.streams = streams
        self.member = member
        self.subs: dict[str, Subscription] = {}
        self.task: asyncio.Task[None] | None = None
        self._gen: Any = None

    async def run(self) -> None:
        key = (self.member.key, self.member.epoch)
        try:
            while True:
                # One streaming call lasts a period (the worker's liveness check of this caller);
                # outputs produced between two calls wait on the worker.
                self._gen = self.member.actor.outputs.remote(self.streams.caller_id)
                async for ref in self._gen:
                    batch = _decoder.decode(await ref)
                    for item in batch.items:
                        sub = self.subs.get(item.request_id)
                        if sub is not None:
                            sub.put(item)
                self._gen = None
                if not self.subs:  # idle: stop; the next subscription starts a new pump
                    return
        except asyncio.CancelledError:
            if self._gen is not None:
                ray.cancel(self._gen)  # the worker aborts this caller's requests
            raise
        except Exception as exc:  # the worker died (RayActorError) or the stream broke
            for sub in list(self.subs.values()):
                sub.fail(exc)
            log.info("output stream from %s ended: %r", self.member.key, exc)
        finally:
            if self.streams.pumps.get(key) is self:
                del self.streams.pumps[key]


class OutputStreams:
    """This caller's pumps, by worker key and epoch."""

    def __init__(self) -> None:
        self.caller_id = uuid.uuid4().hex
        self.pumps: dict[tuple[str, int], _Pump] = {}
        self._watchdog: asyncio.Task[None] | None = None

    def watch(self) -> None:
        """Make sure the watchdog runs: it ends subscription waits that passed their deadline."""
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while self.pumps:
            await asyncio.sleep(WATCH_PERIOD_S)
            now = loop.time()
            for pump in list(self.pumps.values()):
                for sub in list(pump.subs.values()):
                    sub.expire_if_late(now)

    def open(self, member: Member, request_id: str) -> Subscription:
        """Subscribe to a request's outputs on ``member`` (before asking it to produce any)."""
        key = (member.key, member.epoch)
        pump = self.pumps.get(key)
        if pump is None:
            pump = self.pumps[key] = _Pump(self, member)
            pump.task = asyncio.get_running_loop().create_task(pump.run())
        sub = pump.subs[request_id] = Subscription(pump, request_id)
        return sub

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for pump in list(self.pumps.values()):
            if pump.task is not None:
                pump.task.cancel()
        self.pumps.clear()
