"""Fault injection for tests, installed from outside the production classes.

``DelayingAgent`` wraps a transfer agent so that every transfer it starts reports completion only
``delay_s`` after it was issued (the data still moves at once). ``delay_transfers`` installs it on
a running worker through ``EngineWorker.call``::

    ray.get(worker.call.remote(delay_transfers, 3.0))   # later transfers are late by 3 s
    ray.get(worker.call.remote(delay_transfers, 0.0))   # and on time again
"""

from __future__ import annotations

import time
from typing import Any

from moriio_ray.errors import TransferTimeout
from moriio_ray.transfer.handle import Transfer


class DelayedTransfer(Transfer):
    """A transfer that reports completion only ``delay_s`` after it was issued."""

    def __init__(self, inner: Transfer, delay_s: float) -> None:
        self.inner = inner
        self.num_bytes = inner.num_bytes
        self.num_segments = inner.num_segments
        self.peer_key = inner.peer_key
        self.ready_at_s = time.monotonic() + delay_s

    def done(self) -> bool:
        return time.monotonic() >= self.ready_at_s and self.inner.done()

    def error(self) -> BaseException | None:
        return self.inner.error() if self.done() else None

    def wait(self, timeout_s: float | None = None) -> None:
        start = time.monotonic()
        remaining = self.ready_at_s - start
        if timeout_s is not None and remaining > timeout_s:
            time.sleep(max(timeout_s, 0.0))
            raise TransferTimeout(
                f"transfer with {self.peer_key!r} did not finish within {timeout_s} s (delayed)"
            )
        if remaining > 0:
            time.sleep(remaining)
        left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - start))
        self.inner.wait(left)


class DelayingAgent:
    """An agent whose ``read`` and ``write`` return ``DelayedTransfer``s; the rest is ``inner``'s."""

    def __init__(self, inner: Any, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def read(self, *args: Any, **kwargs: Any) -> Transfer:
        return DelayedTransfer(self.inner.read(*args, **kwargs), self.delay_s)

    def write(self, *args: Any, **kwargs: Any) -> Transfer:
        return DelayedTransfer(self.inner.write(*args, **kwargs), self.delay_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def delay_transfers(core: Any, delay_s: float) -> None:
    """For ``EngineWorker.call``: the worker's later transfers are late by ``delay_s`` (0: none)."""
    agent = core.agent.inner if isinstance(core.agent, DelayingAgent) else core.agent
    core.agent = DelayingAgent(agent, delay_s) if delay_s > 0 else agent
