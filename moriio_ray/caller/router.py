"""Picks a prefill and a decode worker per request: power of two choices on outstanding tokens.

Placement constraints: a backend that reaches only its own host (``shm``, ``cuda_ipc``) pairs P and
D on the same node; ``node_id`` pins a pick to one node.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from moriio_ray.errors import CapacityError
from moriio_ray.protocol.messages import Member, Membership


class Router:
    """Least outstanding work among two random candidates. Not thread-safe (one asyncio loop)."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)
        self.membership = Membership(version=-1)
        self.outstanding: dict[str, int] = {}
        self.served: dict[str, int] = {}

    def update(self, membership: Membership) -> None:
        if membership.version <= self.membership.version:
            return
        old = {m.key: m.epoch for m in self.membership.members}
        for m in membership.members:
            if old.get(m.key, m.epoch) != m.epoch:  # a replacement starts with a clean record
                self.served.pop(m.key, None)
        self.membership = membership
        live = {m.key for m in membership.members}
        for key in list(self.outstanding):
            if key not in live and self.outstanding[key] <= 0:
                del self.outstanding[key]

    def pick(
        self,
        role: str,
        *,
        exclude: Iterable[str] = (),
        node_id: str | None = None,
    ) -> Member:
        """A live worker of ``role`` (on ``node_id`` when given), avoiding the keys in ``exclude``."""
        excluded = set(exclude)
        candidates = [
            m
            for m in self.membership.by_role(role)
            if m.key not in excluded and (node_id is None or m.node_id == node_id)
        ]
        if not candidates:
            where = f" on node {node_id[:12]}" if node_id else ""
            have = len(self.membership.by_role(role))
            raise CapacityError(
                f"no live {role} worker{where} to take the request ({have} {role} workers known, "
                f"{len(excluded)} excluded); check the pool and the coordinator's membership"
            )
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        load_a, load_b = self.outstanding.get(a.key, 0), self.outstanding.get(b.key, 0)
        if load_a == load_b:
            return a if self.served.get(a.key, 0) <= self.served.get(b.key, 0) else b
        return a if load_a < load_b else b

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
