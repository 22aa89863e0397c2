"""The coordinator's liveness checks. A death watch (one pending call per actor, which Ray fails
when the actor dies) sees a crash at once. Pings find the silent: every engine (all its ranks) is
pinged once per round, a round spread over ticks and lasting at least ``runtime.health_check_period_s``
and (engine actors / ``runtime.max_health_pings_per_s``) seconds; an actor error, an unhealthy
answer or two missed pings mean dead. A death bumps the worker's epoch and publishes its removal in
the membership, which every caller's and worker's long poll receives (their transfers with it then
fail with PeerLost), and starts a replacement in the same bundle at the next epoch. ``Coordinator``
inherits these; see ``coordinator/actor.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray

from moriio_ray.config import PipelineConfig
from moriio_ray.coordinator.recovery import Slot
from moriio_ray.protocol.messages import Member

log = logging.getLogger(__name__)
_MISSES_TO_DEAD = 2
TICK_S = 0.1  # a ping round is spread over ticks of about this length


class Liveness:
    """The health half of ``Coordinator`` (its state is the coordinator's)."""

    config: PipelineConfig
    slots: list[Slot]
    deaths: list[dict[str, Any]]
    _closing: bool

    if TYPE_CHECKING:

        def _bump(self, upserts: Sequence[Member] = (), removed: Sequence[tuple[str, int]] = ()) -> None: ...

        def _members(self) -> list[Member]: ...

        def _background(self, coro: Any) -> None: ...

        def _kill(self, workers: list[Any], ranks: list[Any]) -> None: ...

        async def _spawn(self, slot: Slot) -> None: ...

    async def report_failure(self, key: str, epoch: int) -> None:
        """A caller saw ``key`` fail: check it now instead of at the next ping."""
        for slot in self.slots:
            if slot.member is not None and slot.member.key == key and slot.member.epoch == epoch:
                await self._ping(slot, timeout_s=self.config.runtime.health_check_period_s)

    async def _health_loop(self) -> None:
        """Ping every engine once per round, spread over the round in ticks; a ping that hangs
        delays no other. A round lasts ``health_check_period_s``, or longer when the pool holds
        more actors than ``runtime.max_health_pings_per_s`` allows: a ping costs the coordinator
        about half a millisecond of CPU (``bench/control_plane.py``). A crash is not waited for:
        each actor's death watch (``_watch_death``) fails at once."""
        rt = self.config.runtime
        while not self._closing:
            live = [s for s in self.slots if s.member is not None]
            calls = sum(1 + len(s.ranks) for s in live)
            round_s = max(rt.health_check_period_s, calls / rt.max_health_pings_per_s)
            ticks = max(1, min(len(live), round(round_s / TICK_S)))
            for i in range(ticks):
                await asyncio.sleep(round_s / ticks)
                for slot in live[i::ticks]:
                    if not slot.pinging and slot.member is not None:
                        self._background(self._ping(slot, timeout_s=rt.health_check_period_s * 1.5))

    def _watch_death(self, slot: Slot) -> None:
        """One call per actor of the engine that returns only when the actor dies: its failure
        tells of a crash at once, whatever the ping round's length."""
        member = slot.member
        assert member is not None
        for actor in (member.actor, *slot.ranks):
            self._background(self._until_death(slot, member, actor))

    async def _until_death(self, slot: Slot, member: Member, actor: Any) -> None:
        try:
            await actor.until_death.remote()
        except ray.exceptions.RayActorError as exc:
            if slot.member is member and not self._closing:
                self._on_dead(slot, f"actor died: {type(exc).__name__}")
        except Exception as exc:  # not a death: the pings decide
            log.debug("death watch of %s ended: %r", member.key, exc)

    async def _ping(self, slot: Slot, *, timeout_s: float) -> None:
        member = slot.member
        if member is None:
            return
        slot.pinging = True
        try:
            # every rank of the engine: a dead rank fails its whole engine
            checks = [a.check_health.remote() for a in (member.actor, *slot.ranks)]
            await asyncio.wait_for(asyncio.gather(*checks), timeout_s)
            slot.misses = 0
            return
        except asyncio.TimeoutError:
            slot.misses += 1
            if slot.misses < _MISSES_TO_DEAD:
                return
            reason = f"no health answer for {slot.misses} pings"
        except ray.exceptions.RayActorError as exc:
            reason = f"actor died: {type(exc).__name__}"
        except Exception as exc:
            reason = f"unhealthy: {exc!r}"
        finally:
            slot.pinging = False
        if slot.member is member:  # not already handled by a concurrent ping
            self._on_dead(slot, reason)

    def _on_dead(self, slot: Slot, reason: str) -> None:
        member = slot.member
        assert member is not None
        log.warning("worker %s epoch %d is dead (%s)", member.key, member.epoch, reason)
        self.deaths.append({"key": member.key, "epoch": member.epoch, "reason": reason, "at": time.time()})
        slot.member = None
        self._kill([member.actor], slot.ranks)
        slot.ranks = []
        # every watcher's long poll answers with the removal (a worker then fails its transfers
        # with that peer): no call per peer here
        self._bump(removed=[(member.key, member.epoch)])
        if self.config.runtime.replace_dead_workers and not self._closing:
            self._background(self._replace(slot))

    async def _replace(self, slot: Slot) -> None:
        try:
            await self._spawn(slot)
            log.warning("replaced %s-%d at epoch %d", slot.role, slot.index, slot.epoch)
        except Exception as exc:
            log.error("could not replace %s-%d: %r", slot.role, slot.index, exc)
