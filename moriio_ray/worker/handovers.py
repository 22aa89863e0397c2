"""P's hand-overs to D, batched: one ``deliver`` call per D per turn of P's event loop.

One engine step ends many prefills at once (64 at c=64), and each used to cost its own Ray call, a
few hundred microseconds of submission on P and of receipt on D, paid one after the other on both
sides under each process's GIL: at c=64 on one GPU READ's hand-over waited 26 ms from P to D for a
transfer of under a millisecond. The prefills that end in one step resume in one turn of P's loop;
each queues its hand-over here, and the first one to name a D schedules that D's call for the end
of the turn, carrying every hand-over queued by then.

Each hand-over keeps its own outcome: D answers the call with one entry per item (``None``, or why
it was refused or failed) once every item's blocks are no longer needed. The call goes outside the
request's Ray task lineage (``protocol/detached.py``) like every clean-up, so a client that leaves
cannot cancel it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from moriio_ray.protocol.deadline import deadline
from moriio_ray.protocol.detached import send
from moriio_ray.worker.peers import Peer

Item = tuple[bytes, bytes, str]
"""One hand-over as ``deliver`` takes it: the packed request, the packed ``Handoff``, the caller."""


def refusal(outcome: asyncio.Future[str | None]) -> str | None:
    """Why a hand-over did not go through (D's answer, or the call's error), or ``None``."""
    if outcome.cancelled():
        return None
    exc = outcome.exception()
    return repr(exc) if exc is not None else outcome.result()


@dataclass
class _Batch:
    peer: Peer
    wait_s: float = 0.0
    items: list[Item] = field(default_factory=list)
    outcomes: list[asyncio.Future[str | None]] = field(default_factory=list)


class Handovers:
    """Queues hand-overs per D and sends each D's queue as one call at the end of the loop turn."""

    def __init__(self, spawn: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
        self._spawn = spawn  # the worker's detached background tasks
        self._queued: dict[str, _Batch] = {}  # D's key -> its hand-overs not yet sent
        self.calls = 0  # deliver calls sent (each carries one batch)
        self.items = 0  # hand-overs sent

    def hand_over(self, peer: Peer, item: Item, wait_s: float) -> asyncio.Future[str | None]:
        """Queue one hand-over to ``peer``; the future ends with D's outcome for it (``None``: D
        took it), or with the call's error (``DeadlineExceeded`` past ``wait_s``, D's death)."""
        loop = asyncio.get_running_loop()
        batch = self._queued.get(peer.key)
        if batch is None or batch.peer.epoch != peer.epoch:
            if batch is not None:  # D was replaced within this turn: the old one's batch goes now
                self._send(peer.key)
            batch = self._queued[peer.key] = _Batch(peer)
            loop.call_soon(self._send_if_queued, peer.key, batch)
        outcome: asyncio.Future[str | None] = loop.create_future()
        batch.items.append(item)
        batch.outcomes.append(outcome)
        batch.wait_s = max(batch.wait_s, wait_s)
        return outcome

    def _send_if_queued(self, key: str, batch: _Batch) -> None:
        if self._queued.get(key) is batch:
            self._send(key)

    def _send(self, key: str) -> None:
        batch = self._queued.pop(key)
        self.calls += 1
        self.items += len(batch.items)
        self._spawn(self._call(batch))

    async def _call(self, batch: _Batch) -> None:
        try:
            call = send(batch.peer.actor.deliver, batch.items)
            outcomes: list[str | None] = await deadline(call, batch.wait_s, f"{batch.peer.key}'s reads")
            if len(outcomes) != len(batch.items):
                what = f"{batch.peer.key} answered {len(outcomes)} of {len(batch.items)} hand-overs"
                raise RuntimeError(what)
        except BaseException as exc:
            for future in batch.outcomes:
                if not future.done():
                    future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            if not isinstance(exc, Exception):
                raise
            return
        for future, outcome in zip(batch.outcomes, outcomes, strict=True):
            if not future.done():
                future.set_result(outcome)
