"""One record per request on a worker, and the table that finds it by request id or engine id.

The record holds everything the worker keeps for a request: whose stream gets its tokens, the
prefill it waits for, D's reservation, P's layer pusher, the task serving it and its cancel mark.
A cancel that arrives before its request (the caller gave up while the call was in flight) is kept
as a mark, so that the request is refused when it comes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moriio_ray.engine.outputs import StepOutput
from moriio_ray.errors import InvalidRequest, RequestCancelled
from moriio_ray.protocol.messages import DecodeStart, Reservation

if TYPE_CHECKING:
    from moriio_ray.worker.push import LayerPusher

_MARKS_KEPT = 1024


@dataclass(eq=False)
class WorkerRequest:
    request_id: str  # the caller's id; also the lease's transfer id on P
    engine_id: str  # its id inside the engine (a recompute under quarantine takes a fresh one)
    caller: str | None = None  # the caller whose output stream carries its tokens
    prefill_out: asyncio.Future[StepOutput] | None = None  # P: resolved by the prefill's output
    reservation: Reservation | None = None  # D (WRITE): the blocks P pushes into
    pushes_ended: bool = False  # D (WRITE): no push into the reservation can land any more
    pusher: LayerPusher | None = None  # P (WRITE): pushes each computed layer
    task: asyncio.Task[object] | None = None  # the call serving it, cancelled by an abort
    start: DecodeStart | None = None  # D: its hand-over timings, sent with its first output
    cancelled: bool = False

    def check_cancelled(self) -> None:
        if self.cancelled:
            raise RequestCancelled(f"request {self.request_id} was cancelled")


class RequestTable:
    """The worker's live requests (asyncio thread; the engine thread only reads ``by_engine``)."""

    def __init__(self, mark_ttl_s: float) -> None:
        self._by_id: dict[str, WorkerRequest] = {}
        self._by_engine: dict[str, WorkerRequest] = {}
        self._marks: dict[str, float] = {}  # request id -> when its cancel came, before the request
        self._mark_ttl_s = mark_ttl_s

    def __len__(self) -> int:
        return len(self._by_id)

    def open(self, request_id: str, caller: str | None = None) -> WorkerRequest:
        """A new record; RequestCancelled if a cancel came first, InvalidRequest for a duplicate."""
        if self._marks.pop(request_id, None) is not None:
            raise RequestCancelled(f"request {request_id} was cancelled before it arrived")
        if request_id in self._by_id:
            raise InvalidRequest(f"request_id: {request_id!r} is already in use on this worker")
        rec = WorkerRequest(request_id=request_id, engine_id=request_id, caller=caller)
        self._by_id[request_id] = rec
        self._by_engine[rec.engine_id] = rec
        return rec

    def get(self, request_id: str) -> WorkerRequest | None:
        return self._by_id.get(request_id)

    def by_engine(self, engine_id: str) -> WorkerRequest | None:
        return self._by_engine.get(engine_id)

    def rekey(self, rec: WorkerRequest, engine_id: str) -> None:
        """The request continues in the engine under ``engine_id``."""
        self._by_engine.pop(rec.engine_id, None)
        rec.engine_id = engine_id
        self._by_engine[engine_id] = rec

    def close(self, rec: WorkerRequest) -> None:
        """Forget a record (idempotent)."""
        if self._by_id.get(rec.request_id) is rec:
            del self._by_id[rec.request_id]
        if self._by_engine.get(rec.engine_id) is rec:
            del self._by_engine[rec.engine_id]

    def cancel(self, request_id: str) -> WorkerRequest | None:
        """Mark a request cancelled; its record, or None (then the mark waits for it)."""
        rec = self._by_id.get(request_id)
        if rec is not None:
            rec.cancelled = True
            return rec
        now = time.monotonic()
        self._marks[request_id] = now
        if len(self._marks) > _MARKS_KEPT:  # forget old marks; a request id is used once
            self._marks = {k: t for k, t in self._marks.items() if now - t < self._mark_ttl_s}
        return None

    def records(self) -> list[WorkerRequest]:
        return list(self._by_id.values())

    def of_caller(self, caller: str) -> list[WorkerRequest]:
        return [rec for rec in self._by_id.values() if rec.caller == caller]

    def callers(self) -> set[str]:
        return {rec.caller for rec in self._by_id.values() if rec.caller is not None}
