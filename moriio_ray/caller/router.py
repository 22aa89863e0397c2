"""Picks a prefill and a decode worker per request: power of two choices on outstanding tokens.

Placement constraints: a backend that reaches only its own host (``shm``, ``cuda_ipc``) pairs P and
D on the same node; ``node_id`` pins a pick to one node.

A pick costs the same at 1,000 workers as at 2: the membership is indexed by role and by (role,
node) when it changes, and two candidates are drawn from the index (``bench/control_plane.py``).
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from moriio_ray.errors import CapacityError
from moriio_ray.protocol.membership import merge
from moriio_ray.protocol.messages import Member, Membership

_DRAWS = 8  # random draws that may hit excluded workers before a pick scans the candidates


class Router:
    """Least outstanding work among two random candidates. Not thread-safe (one asyncio loop)."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)
        self.membership = Membership(version=-1)
        self.outstanding: dict[str, int] = {}
        self.served: dict[str, int] = {}
        self._index: dict[tuple[str, str | None], list[Member]] = {}
        self._by_key: dict[str, Member] = {}

    @property
    def version(self) -> int:
        return self.membership.version

    def find(self, key: str) -> Member | None:
        """The live member ``key``, if this router knows it."""
        return self._by_key.get(key)

    def update(self, membership: Membership) -> bool:
        """Take a snapshot or a change (an older one is ignored); False when a change does not
        start at this router's version (ask for a snapshot)."""
        if membership.version <= self.membership.version:
            return True
        merged = merge(self.membership, membership)
        if merged is None:
            return False
        old = {m.key: m.epoch for m in self.membership.members}
        for m in merged.members:
            if old.get(m.key, m.epoch) != m.epoch:  # a replacement starts with a clean record
                self.served.pop(m.key, None)
        self.membership = merged
        self._by_key = {m.key: m for m in merged.members}
        for key in list(self.outstanding):
            if key not in self._by_key and self.outstanding[key] <= 0:
                del self.outstanding[key]
        index: dict[tuple[str, str | None], list[Member]] = {}
        for m in merged.members:
            index.setdefault((m.role, None), []).append(m)
            index.setdefault((m.role, m.node_id), []).append(m)
        self._index = index
        return True

    def pick(
        self,
        role: str,
        *,
        exclude: Iterable[str] = (),
        node_id: str | None = None,
    ) -> Member:
        """A live worker of ``role`` (on ``node_id`` when given), avoiding the keys in ``exclude``."""
        excluded = exclude if isinstance(exclude, (set, frozenset)) else set(exclude)
        pool = self._index.get((role, node_id), [])
        pair = self._draw(pool, excluded)
        if pair is None:  # many excluded: take the candidates as they are
            candidates = [m for m in pool if m.key not in excluded]
            if not candidates:
                where = f" on node {node_id[:12]}" if node_id else ""
                have = len(self._index.get((role, None), []))
                raise CapacityError(
                    f"no live {role} worker{where} to take the request ({have} {role} workers known, "
                    f"{len(excluded)} excluded); check the pool and the coordinator's membership"
                )
            if len(candidates) == 1:
                return candidates[0]
            a, b = self._rng.sample(candidates, 2)
        else:
            a, maybe_b = pair
            if maybe_b is None:
                return a
            b = maybe_b
        load_a, load_b = self.outstanding.get(a.key, 0), self.outstanding.get(b.key, 0)
        if load_a == load_b:
            return a if self.served.get(a.key, 0) <= self.served.get(b.key, 0) else b
        return a if load_a < load_b else b

    def _draw(
        self, pool: list[Member], excluded: set[str] | frozenset[str]
    ) -> tuple[Member, Member | None] | None:
        """Two distinct random members of ``pool`` not excluded (one, when the pool has one); None
        when the draws keep hitting excluded ones."""
        if not excluded:
            if len(pool) < 2:
                return (pool[0], None) if pool else None
            i, j = self._rng.sample(range(len(pool)), 2)
            return pool[i], pool[j]
        if len(pool) - len(excluded) < 2:
            return None
        first: Member | None = None
        for _ in range(_DRAWS):
            m = pool[self._rng.randrange(len(pool))]
            if m.key in excluded or m is first:
                continue
            if first is None:
                first = m
            else:
                return first, m
        return None

    def pick_decode_for(self, prefill: Member, *, exclude: Iterable[str] = ()) -> Member:
        """A decode worker that can reach ``prefill`` (same node when the backend needs it)."""
        node = prefill.node_id if prefill.same_host_only else None
        return self.pick("decode", exclude=exclude, node_id=node)

    def pick_prefill_for(self, decode: Member, *, exclude: Iterable[str] = ()) -> Member:
        node = decode.node_id if decode.same_host_only else None
        return self.pick("prefill", exclude=exclude, node_id=node)

    def acquire(self, member: Member, tokens: int) -> None:
        self.outstanding[member.key] = self.outstanding.get(member.key, 0) + tokens
        self.served[member.key] = self.served.get(member.key, 0) + 1

    def release(self, member: Member, tokens: int) -> None:
        self.outstanding[member.key] = self.outstanding.get(member.key, 0) - tokens
