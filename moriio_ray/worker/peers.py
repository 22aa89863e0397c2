"""A worker's view of its peers: descriptors from the coordinator, connected once per peer pair.

A tensor-parallel peer is one member with several ranks (``WorkerInfo.rank_descs``): this agent
connects to the peer ranks that share KV heads with its own cache, and a lost peer drops all of
them, here and (``on_lost``) on this engine's other ranks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moriio_ray.errors import PeerLost, StaleDescriptor
from moriio_ray.protocol.deadline import deadline
from moriio_ray.protocol.messages import Member, WorkerInfo
from moriio_ray.transfer.layout import KVLayout
from moriio_ray.transfer.plan import rank_pairs

if TYPE_CHECKING:
    from moriio_ray.transfer.base import TransferAgent  # (torch: the worker's process has it)

log = logging.getLogger(__name__)


@dataclass
class Peer:
    key: str
    epoch: int
    info: WorkerInfo
    member: Member

    @property
    def actor(self) -> Any:
        """Its Ray actor (looked up by name on first use)."""
        return self.member.actor


class PeerDirectory:
    """Resolves (key, epoch) to a connected peer; a lost or replaced peer raises PeerLost."""

    def __init__(
        self,
        agent: TransferAgent,
        coordinator: Any,
        timeout_s: float,
        layout: KVLayout | None = None,
        on_lost: Callable[[list[str]], None] | None = None,
    ) -> None:
        self.agent = agent
        self.coordinator = coordinator
        self.timeout_s = timeout_s
        self.layout = layout  # this agent's cache: which peer ranks it moves KV with
        self.on_lost = on_lost
        self._peers: dict[str, Peer] = {}
        self._known: dict[str, Member] = {}  # the membership's live members (``learn``)
        self._lost: dict[str, int] = {}  # key -> highest epoch known dead
        self._connecting: dict[tuple[str, int], asyncio.Task[Peer]] = {}

    async def get(self, key: str, epoch: int) -> Peer:
        peer = self._peers.get(key)
        if peer is not None and peer.epoch == epoch:
            return peer
        self._check_alive(key, epoch, peer)
        task = self._connecting.get((key, epoch))
        if task is None:
            task = asyncio.ensure_future(self._resolve(key, epoch))
            self._connecting[(key, epoch)] = task
            task.add_done_callback(lambda _t: self._connecting.pop((key, epoch), None))
        return await asyncio.shield(task)

    async def add_members(self, members: list[Member], *, roles: set[str]) -> None:
        """Connect eagerly to every live member of the given roles (connect once, not per request)."""
        for m in members:
            if m.role in roles and m.key != self.agent.key:
                try:
                    await self.get(m.key, m.epoch)
                except Exception as exc:  # a peer that died meanwhile is handled on use
                    log.warning("could not connect to peer %s epoch %d: %r", m.key, m.epoch, exc)

    def learn(self, members: list[Member], *, whole: bool) -> None:
        """Members the coordinator published (``whole``: every live one), so that resolving one
        of them needs no lookup."""
        if whole:
            self._known.clear()
        for m in members:
            self._known[m.key] = m

    def lost(self, key: str, epoch: int) -> None:
        """The coordinator saw ``key`` at ``epoch`` die: drop it and fail its in-flight transfers."""
        self._lost[key] = max(epoch, self._lost.get(key, 0))
        known = self._known.get(key)
        if known is not None and known.epoch <= epoch:
            del self._known[key]
        peer = self._peers.get(key)
        if peer is not None and peer.epoch <= epoch:
            del self._peers[key]
            keys = [r.engine_desc.key for r in peer.info.rank_descs()]
            for rank_key in keys:
                self.agent.disconnect(rank_key)
            if self.on_lost is not None:
                self.on_lost(keys)

    def _check_alive(self, key: str, epoch: int, peer: Peer | None) -> None:
        if epoch <= self._lost.get(key, 0):
            raise PeerLost(f"peer {key!r} epoch {epoch} died")
        if peer is not None and peer.epoch > epoch:
            raise PeerLost(f"peer {key!r} epoch {epoch} was replaced by epoch {peer.epoch}")

    async def _resolve(self, key: str, epoch: int) -> Peer:
        member = self._known.get(key)
        if member is None or member.epoch != epoch:  # not published to this worker yet
            member = await deadline(
                self.coordinator.lookup.remote(key), self.timeout_s, f"the coordinator's lookup of {key!r}"
            )
        if member is None or member.epoch != epoch:
            now = "gone" if member is None else f"at epoch {member.epoch}"
            raise PeerLost(f"peer {key!r} epoch {epoch} is no longer registered (now {now})")
        info = member.info
        self._check_alive(key, epoch, self._peers.get(key))
        try:
            for desc in self._rank_descs(info):
                await asyncio.to_thread(self.agent.connect, desc)
        except StaleDescriptor as exc:
            raise PeerLost(str(exc)) from exc
        peer = Peer(key=key, epoch=epoch, info=info, member=member)
        self._peers[key] = peer
        return peer

    def _rank_descs(self, info: WorkerInfo) -> list[Any]:
        """The peer's ranks this agent exchanges KV with (its only rank at TP = 1)."""
        if not info.ranks or self.layout is None:
            return [info.engine_desc]
        ranks = info.rank_descs()
        return [ranks[j].engine_desc for _, j in rank_pairs([self.layout], [r.layout for r in ranks])]
