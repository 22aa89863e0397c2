"""The coordinator's log of membership changes: what it answers a long poll with.

A watcher at version v gets the change from v to now (the members added or replaced, the keys
gone), not the whole pool: at 1,000 engines and 100 callers a death costs each watcher one small
answer instead of a thousand members. A watcher older than the log (or new) gets a snapshot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from moriio_ray.protocol.messages import Member, Membership

LOG_VERSIONS = 4096  # changes kept; a watcher further behind gets a snapshot


class ChangeLog:
    def __init__(self, limit: int = LOG_VERSIONS) -> None:
        # (version, members added or replaced, (key, epoch) removed), oldest first
        self._log: deque[tuple[int, list[Member], list[tuple[str, int]]]] = deque(maxlen=limit)

    def record(self, version: int, upserts: list[Member], removed: list[tuple[str, int]]) -> None:
        self._log.append((version, upserts, removed))

    def clear(self) -> None:
        """Forget every change (a restart: every watcher then gets a snapshot)."""
        self._log.clear()

    def answer(self, since: int, version: int, members: Callable[[], list[Member]]) -> Membership:
        """What a watcher at ``since`` needs to reach ``version``: the change, or a snapshot of
        ``members()`` when ``since`` is older than the log."""
        if since < 0 or since > version or not self._log or since < self._log[0][0] - 1:
            return Membership(version=version, members=members())
        upserts: dict[str, Member] = {}
        removed: dict[str, int] = {}
        for v, added, gone in self._log:
            if v <= since:
                continue
            for key, epoch in gone:
                upserts.pop(key, None)
                removed[key] = epoch
            for m in added:
                upserts[m.key] = m
                removed.pop(m.key, None)
        return Membership(
            version=version, members=list(upserts.values()), base_version=since, removed=list(removed.items())
        )
