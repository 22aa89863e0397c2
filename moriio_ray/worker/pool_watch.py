"""A worker's view of its pool: one long poll of the coordinator's membership, as deltas.

From each answer the worker learns its peers' descriptors (so that a first transfer with a peer
needs no lookup), connects eagerly to new peers of the role it exchanges KV with while there are at
most ``EAGER_PEERS`` of them (beyond that, a peer pair connects on first use), and drops the peers
gone. The same poll tells when the coordinator is gone for good: the workers are detached, so
nothing else would end the pool after its driver died.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from moriio_ray.protocol.membership import POLL_S, MembershipWatch, apply
from moriio_ray.protocol.messages import Member, Membership, Role
from moriio_ray.worker.peers import PeerDirectory

log = logging.getLogger(__name__)
EAGER_PEERS = 64  # connect to every peer eagerly up to this many; beyond it, on first use
RETRY_S = 2.0  # after a failed poll
MISSES_TO_GONE = 3  # polls in a row that find the coordinator dead (each a fresh call)
TALKS_TO = {Role.PREFILL.value: Role.DECODE.value, Role.DECODE.value: Role.PREFILL.value}


class PoolWatch:
    """Keeps ``membership`` current and the peer directory in step with it."""

    def __init__(self, coordinator: Any, peers: PeerDirectory, role: str, remote_timeout_s: float) -> None:
        self.version = -1
        self.members: dict[str, Member] = {}  # a change costs its own size, not the pool's
        self.peers = peers
        self.talks_to = TALKS_TO.get(role)
        self.watch = MembershipWatch(coordinator, self, remote_timeout_s, self._on_answer)
        self._connects: set[asyncio.Task[None]] = set()

    def update(self, membership: Membership) -> bool:
        if membership.version <= self.version:
            return True
        if membership.is_delta and membership.base_version != self.version:
            return False
        apply(self.members, membership)
        self.version = membership.version
        return True

    async def _on_answer(self, answer: Membership) -> None:
        for key, epoch in answer.removed:
            self.peers.lost(key, epoch)
        self.peers.learn(answer.members, whole=not answer.is_delta)
        if self.talks_to is None:
            return
        new = [m for m in answer.members if m.role == self.talks_to]
        if new and sum(m.role == self.talks_to for m in self.members.values()) <= EAGER_PEERS:
            task = asyncio.ensure_future(self.peers.add_members(new, roles={self.talks_to}))
            self._connects.add(task)
            task.add_done_callback(self._connects.discard)

    async def run(self, closed: Callable[[], bool]) -> bool:
        """Poll until ``closed()``; True when the coordinator is gone for good (its actor is dead
        on ``MISSES_TO_GONE`` polls in a row). A coordinator that Ray restarts answers again
        within seconds; meanwhile this worker keeps serving on the peers it knows."""
        import ray

        misses = 0
        while not closed():
            try:
                await self.watch.refresh(timeout_s=POLL_S)
                misses = 0
                continue
            except ray.exceptions.ActorDiedError:
                misses += 1
                if misses >= MISSES_TO_GONE:
                    return True
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # restarting, or slow: not gone
                log.debug("membership poll failed: %r", exc)
                misses = 0
            await asyncio.sleep(RETRY_S)
        return False
