"""Faults of a running worker, installed from outside the production classes through
``EngineWorker.call`` (each function takes the worker's ``WorkerCore`` first)::

    ray.get(worker.call.remote(fail_next_step))         # the engine's next step raises
    worker.call.remote(block_event_loop, 600.0)         # the worker's asyncio loop hangs (no ray.get)

A hang is bounded (``seconds``), so that a test that fails leaves no thread behind forever; the
coordinator kills a hung worker long before.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any

from moriio_ray.transfer.tcp_server import TcpServer

DEVICE_ERROR = "injected device error"


def fail_next_step(core: Any) -> None:
    """The engine's next step raises, as a forward pass that hits a device error would."""

    def step() -> Any:
        raise RuntimeError(DEVICE_ERROR)

    core.engine.step = step


def slow_steps(core: Any, delay_s: float) -> None:
    """Every later engine step takes ``delay_s`` longer (0: back to normal)."""
    core.engine.__dict__.pop("step", None)  # the class's step again
    if delay_s <= 0:
        return
    inner = core.engine.step

    def step() -> Any:
        time.sleep(delay_s)
        return inner()

    core.engine.step = step


def hang_engine_thread(core: Any, seconds: float) -> None:
    """The engine thread enters a call that does not return for ``seconds`` (a hung device call)."""
    core.loop.post(lambda: time.sleep(seconds))


def block_event_loop(core: Any, seconds: float) -> None:
    """The worker's asyncio loop blocks for ``seconds``: a method that never returns, and no ping
    is answered. Call it without waiting for the answer."""
    time.sleep(seconds)


def ignore_prefills(core: Any, ignore: bool = True) -> None:
    """The engine takes prefill requests and never runs them (a call that never answers), while
    the engine thread and the event loop stay healthy. ``ignore=False`` restores it."""
    if ignore:
        core.engine.add_request = lambda *args, **kwargs: None
    else:
        core.engine.__dict__.pop("add_request", None)


def live_callers(core: Any) -> dict[str, int]:
    """Live requests on the worker, by caller id."""
    return dict(Counter(rec.caller for rec in core.table.records() if rec.caller is not None))


class _StallingTcpServer(TcpServer):
    """A tcp server that parks every read request it serves until released (a peer that stops
    sending mid-read, and is then killed)."""

    stalled: threading.Event
    release: threading.Event

    def _request(self, conn: Any, op: int, *args: Any) -> None:
        self.stalled.set()
        self.release.wait(60.0)
        super()._request(conn, op, *args)


def stall_reads(core: Any) -> None:
    """The worker's tcp server (P's, in READ) parks the read requests it serves from now on."""
    server = core.agent._server
    server.stalled, server.release = threading.Event(), threading.Event()
    server.__class__ = _StallingTcpServer


async def wait_stalled(core: Any, timeout_s: float) -> bool:
    """Whether a read reached the stalled server within ``timeout_s``."""
    return await asyncio.to_thread(core.agent._server.stalled.wait, timeout_s)
