"""Keeping a view of the pool current: a long poll of the coordinator's membership, as deltas.

Callers (their router) and workers (their peers) hold a view; ``MembershipWatch`` long-polls the
coordinator for the change since the view's version and applies it with ``merge``. The coordinator
answers with a whole snapshot when the view is too old for its change log (or empty), so a view
never needs more than one answer to be current.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec

from moriio_ray.protocol.deadline import deadline
from moriio_ray.protocol.messages import Member, Membership

log = logging.getLogger(__name__)
POLL_S = 30.0  # one long poll waits this long for a newer version (a change answers it at once)
RETRY_S = 1.0  # after a failed poll


def apply(members: dict[str, Member], update: Membership) -> None:
    """Apply ``update`` to ``members`` (by key) in place: a snapshot replaces them, a change costs
    its own size. The caller checks that a change starts at its version."""
    if not update.is_delta:
        members.clear()
    for key, _ in update.removed:
        members.pop(key, None)
    members.update((m.key, m) for m in update.members)


def merge(current: Membership, update: Membership) -> Membership | None:
    """``current`` after ``update``; None when ``update`` is a change from another version."""
    if not update.is_delta:
        return update
    if update.base_version != current.version:
        return None
    members = {m.key: m for m in current.members}
    apply(members, update)
    return Membership(version=update.version, members=list(members.values()))


def pack(m: Membership) -> bytes:
    """``m`` as msgpack: what the coordinator sends every watcher (a pickled Membership costs it
    several times more per answer)."""
    members = [[getattr(x, f) for f in Member.FIELDS] for x in m.members]
    return msgspec.msgpack.encode([m.version, m.base_version, m.removed, members])


def unpack(data: bytes) -> Membership:
    version, base_version, removed, members = msgspec.msgpack.decode(data)
    return Membership(
        version=version,
        members=[Member(*fields) for fields in members],
        base_version=base_version,
        removed=[(key, epoch) for key, epoch in removed],
    )


class View(Protocol):
    """What a watch keeps current (a caller's ``Router``, a worker's ``PoolWatch``)."""

    @property
    def version(self) -> int: ...

    def update(self, membership: Membership) -> bool:
        """Apply a snapshot or a change; False when a change does not apply (a gap)."""
        ...


class MembershipWatch:
    """Keeps ``view`` current; ``on_update`` runs after each poll that answered."""

    def __init__(
        self,
        coordinator: Any,
        view: View,
        remote_timeout_s: float,
        on_update: Callable[[Membership], Awaitable[None]] | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.view = view
        self.remote_timeout_s = remote_timeout_s
        self.on_update = on_update
        self._whole = False  # the last change did not apply: ask for a snapshot
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def refresh(self, timeout_s: float = 0.0) -> Membership:
        """One poll (a long poll of up to ``timeout_s`` for a version above the view's); returns
        what the coordinator answered. DeadlineExceeded if it does not answer within that plus
        remote_timeout_s."""
        since = -1 if self._whole else self.view.version
        packed: bytes = await deadline(
            self.coordinator.watch.remote(since, timeout_s),
            timeout_s + self.remote_timeout_s,
            "the coordinator's membership",
        )
        answer = unpack(packed)
        self._whole = not self.view.update(answer)
        if self.on_update is not None:
            await self.on_update(answer)
        return answer

    def ensure(self) -> bool:
        """Watch from the running event loop (once per loop); True if the watch starts now (the
        view may then be as old as the caller's ``connect``)."""
        loop = asyncio.get_running_loop()
        if self._task is not None and self._loop is loop and not self._task.done():
            return False
        self._loop = loop
        self._task = loop.create_task(self.watch_forever())
        return True

    async def watch_forever(self) -> None:
        while True:
            try:
                await self.refresh(timeout_s=POLL_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # coordinator restarting or gone: back off, keep the old view
                log.warning("membership refresh failed: %r", exc)
                await asyncio.sleep(RETRY_S)

    def stop(self) -> None:
        """Cancel the watch (from any thread)."""
        if self._task is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._task.cancel)
