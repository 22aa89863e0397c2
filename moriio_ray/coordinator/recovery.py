"""A coordinator taking its pool back after Ray restarted it: what it keeps in the GCS after every
membership change (``_save``), and how it adopts the workers that outlived its process
(``_recover``, ``_adopt``). ``Coordinator`` inherits these; see ``coordinator/actor.py``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from moriio_ray.config import PipelineConfig
from moriio_ray.coordinator.changes import ChangeLog
from moriio_ray.coordinator.engine_group import rank_name
from moriio_ray.protocol import pool_state as state
from moriio_ray.protocol.messages import Member, WorkerInfo

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

log = logging.getLogger(__name__)
NAMESPACE = state.NAMESPACE


@dataclass
class Slot:
    """One engine's place in the pool: its bundle, its current worker and that worker's epoch."""

    role: str
    index: int
    bundle_index: int
    epoch: int = 0
    member: Member | None = None
    misses: int = 0
    starting: bool = False
    pinging: bool = False  # a ping of this engine is in flight
    ranks: list[Any] = field(default_factory=list)  # tensor parallelism: the actors of ranks 1..


class Recovery:
    """The restart half of ``Coordinator`` (its state is the coordinator's)."""

    config: PipelineConfig
    version: int
    slots: list[Slot]
    pg: PlacementGroup | None
    restarts: int
    _closing: bool
    _changed: asyncio.Event | None
    changes: ChangeLog
    _health: asyncio.Task[None] | None

    if TYPE_CHECKING:

        def _bump(self, upserts: Sequence[Member] = (), removed: Sequence[tuple[str, int]] = ()) -> None: ...

        def _background(self, coro: Any) -> None: ...

        async def _replace(self, slot: Slot) -> None: ...

        async def _health_loop(self) -> None: ...

        def _watch_death(self, slot: Slot) -> None: ...

    def _save(self) -> None:
        """Keep what a restarted coordinator needs to take the pool back (see ``state``)."""
        if not self.slots or self._closing:
            return
        name = self.config.name
        slots = []
        for s in self.slots:
            worker = state.worker_name(name, s.member.key, s.epoch) if s.member is not None else None
            ranks = [rank_name(worker, r + 1) for r in range(len(s.ranks))] if worker else []
            slots.append(state.StoredSlot(s.role, s.index, s.bundle_index, s.epoch, worker, ranks))
        state.save(name, state.Stored(self.version, state.placement_group_name(name), slots))

    async def _recover(self, stored: state.Stored) -> None:
        """After a restart: take the pool back from ``stored`` (the workers that outlived us),
        publish it at a version above the last one, and replace whoever died meanwhile."""
        self.restarts += 1
        self._changed = asyncio.Event()
        self.version = stored.version
        self.pg = ray.util.get_placement_group(stored.placement_group)
        self.slots = [Slot(s.role, s.index, s.bundle_index, epoch=s.epoch) for s in stored.slots]
        found = await asyncio.gather(
            *(self._adopt(slot, s) for slot, s in zip(self.slots, stored.slots, strict=True))
        )
        log.warning(
            "coordinator of %s restarted: took back %d of %d workers at version %d",
            self.config.name,
            sum(found),
            len(self.slots),
            self.version,
        )
        self.changes.clear()
        self._bump()
        for slot in self.slots:
            if slot.member is not None:
                self._watch_death(slot)
        for slot in self.slots:
            if slot.member is None and self.config.runtime.replace_dead_workers:
                self._background(self._replace(slot))
        self._health = asyncio.ensure_future(self._health_loop())

    async def _adopt(self, slot: Slot, stored: state.StoredSlot) -> bool:
        """The stored worker of ``slot`` if it still lives: its descriptors, published anew."""
        if stored.worker is None:
            return False
        try:
            actor = ray.get_actor(stored.worker, namespace=NAMESPACE)
            ranks = [ray.get_actor(r, namespace=NAMESPACE) for r in stored.ranks]
            info: WorkerInfo = await asyncio.wait_for(
                actor.info.remote(), self.config.runtime.remote_timeout_s
            )
        except Exception as exc:  # gone while we were down: replaced below
            log.warning("worker %s did not come back: %r", stored.worker, exc)
            return False
        slot.ranks = ranks
        slot.member = Member.of(info, role=slot.role, epoch=slot.epoch, actor=actor, actor_name=stored.worker)
        return True
