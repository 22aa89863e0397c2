"""The simulated pool of ``bench/control_plane.py``: the real coordinator over engines that run no model.

- ``SimCoordinator`` is the library's ``Coordinator`` with two seams replaced: it reserves no
  placement group (``_place``) and starts a simulated engine instead of a worker actor
  (``_start_worker``, ``_kill``). Its liveness pings, membership log, long polls, lookups, GCS
  record and replacements are the library's code. It records when each version was published and
  when each death was detected, and times its pings.
- ``SimHost`` is one process hosting many simulated engines (``SimHandle`` is what the coordinator
  holds as an engine's actor). An engine answers pings, registers descriptors of real size (the
  tcp backend's, cloned per engine), follows the membership with the worker's own ``PoolWatch``
  and ``PeerDirectory``, and accepts or refuses the requests routed to it, but runs no model.
- ``SimCallers`` is one process hosting many callers, each a real ``Router`` kept current by a
  real ``MembershipWatch``, routing requests at a given rate.

Each host records when the changes the bench tracks (an engine up or down at an epoch) reached each
of its engines or callers.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import ray

from moriio_ray.config import PipelineConfig
from moriio_ray.coordinator.actor import Coordinator
from moriio_ray.coordinator.recovery import Slot
from moriio_ray.protocol.messages import WorkerInfo

Subject = tuple[str, int, str]  # (engine key, epoch, "up" | "down")
SAMPLES = 20_000  # timing samples kept per series


def rss_bytes() -> int:
    """This process's resident memory now (its peak where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def usage() -> dict[str, float]:
    return {
        "cpu_s": time.process_time(),
        "rss_bytes": float(rss_bytes()),
        "unix": time.time(),
        "pid": os.getpid(),
    }


def reached(subject: Subject, epoch_of: Callable[[str], int | None]) -> bool:
    """Whether a view of the pool (``epoch_of``: a key's epoch there, None if absent) shows ``subject``."""
    key, epoch, kind = subject
    now = epoch_of(key)
    if kind == "up":
        return now is not None and now >= epoch
    return now is None or now > epoch


class _Tracker:
    """When each tracked change reached each engine (or caller) of this process (an engine's own
    change is not counted as reaching it)."""

    def __init__(self) -> None:
        self.subjects: set[Subject] = set()
        self.seen: dict[Subject, dict[str, float]] = defaultdict(dict)

    def observe(self, who: str, epoch_of: Callable[[str], int | None]) -> None:
        now = time.time()
        for s in self.subjects:
            if who != s[0] and who not in self.seen[s] and reached(s, epoch_of):
                self.seen[s][who] = now

    def mark(self, who: str, subject: Subject) -> None:
        if subject in self.subjects and who != subject[0]:
            self.seen[subject].setdefault(who, time.time())

    def report(self) -> dict[str, dict[str, float]]:
        return {"|".join(map(str, s)): dict(v) for s, v in self.seen.items()}


# -- the coordinator ---------------------------------------------------------------------------


class SimHandle:
    """An engine's actor as the coordinator holds it: calls go to its host, with its key."""

    def __init__(self, host: Any, key: str, host_index: int) -> None:
        self.host = host
        self.key = key
        self.host_index = host_index

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self.host, name, self.key)


class _Method:
    def __init__(self, host: Any, name: str, key: str) -> None:
        self.host, self.name, self.key = host, name, key

    def remote(self, *args: Any) -> Any:
        return getattr(self.host, self.name).remote(self.key, *args)


class SimCoordinator(Coordinator):
    """The library's coordinator, its engines simulated (see the module docstring)."""

    def __init__(self, config: PipelineConfig, hosts: list[Any]) -> None:
        super().__init__(config, token=b"\0" * 32)
        self.hosts = hosts
        self.upped: dict[str, float] = {}  # "key|epoch" -> when it was published
        self.versions: dict[str, int] = {}  # "key|epoch" (up or down) -> the version that published it
        self.answered: dict[int, tuple[float, float, int]] = {}  # version -> (first, last answer, count)
        self.snapshots = 0  # answers to a watcher that asked for the whole membership
        self.detected: dict[str, float] = {}  # "key|epoch" -> when its death was seen
        self.ping_s: list[float] = []
        self.ping_gap_s: list[float] = []  # between one engine's successive pings
        self._last_ping: dict[int, float] = {}

    async def _place(self, roles: list[Slot]) -> None:
        self.pg = None  # simulated engines take no resources

    async def _start_worker(self, slot: Slot, key: str) -> tuple[Any, list[Any], WorkerInfo]:
        index = slot.bundle_index % len(self.hosts)
        me = ray.get_runtime_context().current_actor
        info: WorkerInfo = await self.hosts[index].register.remote(
            key, slot.role, slot.epoch, slot.bundle_index, me
        )
        return SimHandle(self.hosts[index], key, index), [], info

    def _kill(self, workers: list[Any], ranks: list[Any]) -> None:
        for w in workers:
            w.host.drop.remote(w.key)

    def _bump(self, upserts: Any = (), removed: Any = ()) -> None:
        super()._bump(upserts, removed)
        now = time.time()
        for m in upserts:
            self.upped[f"{m.key}|{m.epoch}"] = now
            self.versions[f"up|{m.key}|{m.epoch}"] = self.version
        for key, epoch in removed:
            self.versions[f"down|{key}|{epoch}"] = self.version

    async def _ping(self, slot: Slot, *, timeout_s: float) -> None:
        t0 = time.perf_counter()
        last = self._last_ping.get(slot.bundle_index)
        self._last_ping[slot.bundle_index] = t0
        if last is not None and len(self.ping_gap_s) < SAMPLES:
            self.ping_gap_s.append(t0 - last)  # the effective period: configured period + a round
        await super()._ping(slot, timeout_s=timeout_s)
        if slot.misses == 0 and slot.member is not None and len(self.ping_s) < SAMPLES:
            self.ping_s.append(time.perf_counter() - t0)

    async def watch(self, since_version: int = -1, timeout_s: float = 0.0) -> bytes:
        """The library's answer, its time noted: when the coordinator answered each version."""
        packed = await super().watch(since_version, timeout_s)
        self.snapshots += since_version < 0
        if since_version < self.version:
            first, _, count = self.answered.get(self.version, (time.time(), 0.0, 0))
            self.answered[self.version] = (first, time.time(), count + 1)
        return packed

    def _on_dead(self, slot: Slot, reason: str) -> None:
        assert slot.member is not None
        self.detected[f"{slot.member.key}|{slot.member.epoch}"] = time.time()
        super()._on_dead(slot, reason)

    async def scale_up(self, role: str, count: int) -> list[str]:
        """Add ``count`` engines of ``role`` (the library has no scale-up call: this is the path a
        replacement takes, for new slots)."""
        first = len(self.slots)
        index = sum(s.role == role for s in self.slots)
        new = [Slot(role=role, index=index + i, bundle_index=first + i) for i in range(count)]
        self.slots.extend(new)
        await asyncio.gather(*(self._spawn(s) for s in new))
        return [f"{self.config.name}-{role}-{s.index}" for s in new]

    async def epoch_of(self, key: str) -> int:
        member = await self.lookup(key)
        return -1 if member is None else member.epoch

    async def measure(self) -> dict[str, Any]:
        """Usage now, with the ping samples since the last call."""
        pings, self.ping_s = self.ping_s, []
        gaps, self.ping_gap_s = self.ping_gap_s, []
        import sys

        loaded = "torch" in sys.modules
        return {**usage(), "ping_s": pings, "ping_gap_s": gaps, "version": self.version, "torch": loaded}

    async def timeline(self) -> dict[str, Any]:
        return {
            "upped": dict(self.upped),
            "detected": dict(self.detected),
            "versions": dict(self.versions),
            "answered": dict(self.answered),
            "snapshots": self.snapshots,
            "version": self.version,
        }
