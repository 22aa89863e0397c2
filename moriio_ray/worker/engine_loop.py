"""One engine thread per worker: it owns the engine, steps it, and hands each step's outputs over.

The engine is not thread-safe, so every engine call goes through ``call`` (run on the engine thread
between steps) or ``call_now`` (run right here when the engine is idle and its lock is free). Each
step's outputs reach the asyncio loop in one ``call_soon_threadsafe``: the worker's ``on_outputs``
groups them by caller, so a step costs one hop however many requests it advanced.

Threads: the engine thread runs ``_run`` (steps, calls, lease sweeps); everything else here runs on
the worker's asyncio loop.

A hung engine thread (a step or call that never returns: a device hang, a deadlock) leaves the
asyncio loop answering pings, so ``stalled_s`` tells the worker's health check how long the thread
has been inside its current step or call; past a bound the worker reports itself unhealthy.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from moriio_ray.engine.engine import Engine
from moriio_ray.engine.outputs import StepOutput
from moriio_ray.errors import EngineFailed

log = logging.getLogger(__name__)
T = TypeVar("T")

_SWEEP_PERIOD_S = 0.25

OnOutputs = Callable[[list[StepOutput]], None]
OnFailure = Callable[[BaseException], None]


class EngineLoop:
    """Runs ``engine.step()`` on a thread while there is work; serves calls in between."""

    def __init__(
        self,
        engine: Engine,
        loop: asyncio.AbstractEventLoop,
        on_outputs: OnOutputs,
        on_failure: OnFailure,
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._on_outputs = on_outputs
        self._on_failure = on_failure
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future[Any] | None] | None] = (
            queue.SimpleQueue()
        )
        self._step_waiters: list[asyncio.Future[None]] = []
        self._stop = threading.Event()
        self._last_sweep_s = 0.0
        self._busy_since_s: float | None = None  # when the engine thread entered its current step or call
        self.expired_leases = 0  # leases freed by the sweep (nobody released them in time)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- asyncio side ---------------------------------------------------------------------------

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread and return its result (or raise its error)."""
        if self._stop.is_set():
            raise self._stopped_error()
        fut: asyncio.Future[T] = self._loop.create_future()
        self._calls.put((fn, fut))
        return await fut

    async def call_now(self, fn: Callable[[], T]) -> T:
        """Like ``call``, but run ``fn`` right here when the engine is between steps (its lock is
        free): a short call then costs no thread hop. The engine thread is woken afterwards, in
        case ``fn`` gave it work."""
        lock = self.engine.lock
        if not self._stop.is_set() and lock.acquire(blocking=False):
            try:
                return fn()
            finally:
                lock.release()
                self._calls.put(None)
        return await self.call(fn)

    def post(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the engine thread without waiting (its exception is logged)."""
        if not self._stop.is_set():
            self._calls.put((fn, None))

    async def next_step(self) -> None:
        """Wait until the engine finishes one more step (blocks may have been freed)."""
        # No wake-up here: an idle engine answers within one sweep period, a busy one after its step.
        fut: asyncio.Future[None] = self._loop.create_future()
        self._step_waiters.append(fut)
        await fut

    def stalled_s(self) -> float:
        """How long the engine thread has been inside its current step or call (0 while it waits
        for work): a thread that stays in one for long is hung."""
        since = self._busy_since_s
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._calls.put(None)
        self._thread.join(timeout_s)

    # -- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        if self.engine.device.type == "cuda":
            # The current CUDA device is per thread: without this, a worker on cuda:1 would run
            # its engine thread with cuda:0 current (graph captures and new streams land there).
            import torch

            torch.cuda.set_device(self.engine.device)
        while not self._stop.is_set():
            try:
                self._serve_calls(block=not self.engine.has_work())
                self._maybe_sweep()
                if self.engine.has_work():
                    self._busy_since_s = time.monotonic()
                    outputs = self.engine.step()
                    self._busy_since_s = None
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)
                elif self._step_waiters:
                    self._loop.call_soon_threadsafe(self._dispatch, [])
            except BaseException as exc:  # an engine fault must not hang every request
                # (a fault of one request ends that request inside step; what reaches here is the
                # engine's own: a device error, out of memory)
                log.exception("engine loop failed")
                self.error = exc
                self._stop.set()
                self._drain_calls(self._stopped_error())
                self._loop.call_soon_threadsafe(self._fail, exc)

    def _stopped_error(self) -> EngineFailed:
        if self.error is None:
            return EngineFailed("the engine loop is stopped (the worker is shutting down)")
        return EngineFailed(f"the engine failed ({type(self.error).__name__}); retry the request")

    def _drain_calls(self, exc: BaseException) -> None:
        """After a fault: every call still queued fails with it (none waits for its deadline)."""
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1] is not None:
                self._loop.call_soon_threadsafe(_set_exception, item[1], exc)

    def _serve_calls(self, *, block: bool) -> None:
        timeout_s = _SWEEP_PERIOD_S if block else 0.0
        while True:
            try:
                item = self._calls.get(timeout=timeout_s) if block else self._calls.get_nowait()
            except queue.Empty:
                return
            block = False  # after the first item, drain without waiting
            if item is None:
                continue
            fn, fut = item
            self._busy_since_s = time.monotonic()
            try:
                result = fn()
            except BaseException as exc:
                if fut is None:
                    log.warning("posted engine call failed: %r", exc)
                else:
                    self._loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                if fut is not None:
                    self._loop.call_soon_threadsafe(_set_result, fut, result)
            finally:
                self._busy_since_s = None

    def _maybe_sweep(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep_s >= _SWEEP_PERIOD_S:
            self._last_sweep_s = now
            expired = self.engine.sweep_leases()
            if expired:
                self.expired_leases += len(expired)
                log.warning("freed %d expired leases: %s", len(expired), expired[:8])

    # -- back on the asyncio loop ---------------------------------------------------------------

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        if outputs:
            self._on_outputs(outputs)
        waiters, self._step_waiters = self._step_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        for fut in self._step_waiters:
            if not fut.done():
                fut.set_exception(self._stopped_error())
        self._step_waiters = []
        self._on_failure(exc)


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
