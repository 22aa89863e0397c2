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

import numpy as np
import torch

from moriio_ray.errors import TransferTimeout
from moriio_ray.transfer.handle import FutureTransfer, Transfer
from moriio_ray.transfer.plan import TransferPlan


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


class LateWriteAgent:
    """An agent whose writes, while ``holding``, read their source when issued and land in the peer
    only on ``release``: a one-sided push that arrives late, carrying the data it had when issued
    (the prompt it was computed for, whatever the source blocks hold by the time it lands)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.holding = True
        self.held: list[tuple[FutureTransfer, Any, Any, TransferPlan]] = []

    def write(self, local_mem: Any, remote_mem: Any, plan: TransferPlan) -> Transfer:
        if not self.holding:
            return self.inner.write(local_mem, remote_mem, plan)
        lo, ro, sz = plan.local_offsets, plan.remote_offsets, plan.sizes
        source = self.inner.local_tensor(local_mem).reshape(-1).view(torch.uint8)
        staging = self.inner.allocate((int(sz.sum()),), torch.uint8, "cpu")
        starts = np.concatenate([[0], np.cumsum(sz)[:-1]]).astype(np.int64)
        for s, o, n in zip(starts, lo, sz, strict=True):  # the data as it is now
            staging[s : s + n] = source[o : o + n]
        mem = self.inner.register(staging)
        xfer = FutureTransfer(int(sz.sum()), len(sz), remote_mem.engine_key)
        self.held.append((xfer, mem, remote_mem, TransferPlan(starts, ro, sz)))
        return xfer

    def release(self) -> int:
        """Land every held write now; how many there were."""
        held, self.held = self.held, []
        for xfer, mem, remote_mem, plan in held:
            try:
                self.inner.write(mem, remote_mem, plan).wait(10.0)
                xfer.set_done()
            except Exception as exc:  # the peer is gone: the write fails as a real one would
                xfer.set_error(exc)
            finally:
                self.inner.deregister(mem)
        return len(held)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def hold_writes(core: Any) -> None:
    """For ``EngineWorker.call``: from now on the worker's writes are held (``LateWriteAgent``)."""
    if not isinstance(core.agent, LateWriteAgent):
        core.agent = LateWriteAgent(core.agent)
    core.agent.holding = True


def pass_writes(core: Any) -> int:
    """For ``EngineWorker.call``: later writes go through at once; those held stay held. How many are held."""
    core.agent.holding = False
    return len(core.agent.held)


def held_writes(core: Any) -> int:
    return len(core.agent.held) if isinstance(core.agent, LateWriteAgent) else 0


def release_writes(core: Any) -> int:
    """For ``EngineWorker.call``: land the held writes now (from a thread: the worker's loop goes on)."""
    import asyncio

    return asyncio.to_thread(core.agent.release)  # type: ignore[return-value]
