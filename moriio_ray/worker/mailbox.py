"""Hand-over of a prefill's result from P straight to D, keyed by request id.

The caller starts D's decode together with P's prefill and names D to P; P sends its KVHandle
(READ) or PushResult (WRITE) to D the moment it has it, one Ray call, instead of the result
travelling P -> caller -> D. The caller still gets P's result for the first token.
"""

from __future__ import annotations

import asyncio
import time
from typing import Generic, TypeVar

from moriio_ray.errors import DeadlineExceeded, RequestCancelled

T = TypeVar("T")

_KEEP_S = 120.0  # how long a delivery nobody took, or a taken id, is remembered


class Mailbox(Generic[T]):
    """One slot per request id: ``deliver`` may come before or after ``take``; each id is taken once."""

    def __init__(self) -> None:
        self._waiters: dict[str, asyncio.Future[tuple[T, float]]] = {}
        self._early: dict[str, tuple[T, float]] = {}
        self._closed: dict[str, float] = {}  # taken or abandoned ids

    def deliver(self, request_id: str, item: T) -> bool:
        """Hand ``item`` over; False if its request was already served or abandoned (a duplicate)."""
        now = time.time()
        if request_id in self._closed:
            return False
        waiter = self._waiters.get(request_id)
        if waiter is not None and not waiter.done():
            waiter.set_result((item, now))
        else:
            self._forget_old(now)
            self._early[request_id] = (item, now)
        return True

    async def take(self, request_id: str, timeout_s: float) -> tuple[T, float]:
        """The item and the wall-clock time it arrived; DeadlineExceeded after ``timeout_s``."""
        if request_id in self._closed:
            raise RequestCancelled(f"request {request_id} was already served or abandoned here")
        early = self._early.pop(request_id, None)
        if early is not None:
            self._closed[request_id] = time.time()
            return early
        fut: asyncio.Future[tuple[T, float]] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = fut
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"no prefill result for {request_id} within {timeout_s} s") from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # delivered just before the cancel: not lost,
                self._early[request_id] = fut.result()  # ``abandon`` hands it to whoever frees it
            raise
        finally:
            self._waiters.pop(request_id, None)
            self._closed[request_id] = time.time()

    def abandon(self, request_id: str) -> T | None:
        """Nobody will take this id any more; returns an item that had already arrived, if any."""
        self._closed[request_id] = time.time()
        waiter = self._waiters.pop(request_id, None)
        if waiter is not None and not waiter.done():
            waiter.cancel()
        early = self._early.pop(request_id, None)
        return early[0] if early is not None else None

    def _forget_old(self, now: float) -> None:
        horizon = now - _KEEP_S
        if len(self._closed) > 1024:
            self._closed = {k: t for k, t in self._closed.items() if t > horizon}
        if len(self._early) > 1024:
            self._early = {k: v for k, v in self._early.items() if v[1] > horizon}
