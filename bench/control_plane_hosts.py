"""The processes of ``bench/control_plane.py`` that stand in for engines and callers: see
``bench/control_plane_sim.py`` for what each simulates."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import defaultdict, deque
from typing import Any

import msgspec
import ray

from bench.control_plane_sim import SAMPLES, Subject, _Tracker, usage
from moriio_ray.caller.router import Router
from moriio_ray.config import TransferConfig
from moriio_ray.protocol.membership import MembershipWatch
from moriio_ray.protocol.messages import Membership, RankDesc, Role, WorkerInfo
from moriio_ray.transfer.desc import EngineDesc, MemoryDesc
from moriio_ray.transfer.layout import KVLayout
from moriio_ray.worker.peers import PeerDirectory
from moriio_ray.worker.pool_watch import PoolWatch

NODE_ID_HEX = 56  # a Ray node id's length


class NullAgent:
    """A transfer agent that moves nothing; the peer directory's connects are counted."""

    same_host_only = False

    def __init__(self, key: str) -> None:
        self.key = key
        self.connects = 0

    def connect(self, desc: EngineDesc) -> None:
        self.connects += 1

    def disconnect(self, key: str) -> None:
        pass


class _SimPoolWatch(PoolWatch):
    """The worker's pool watch, its views reported to the host's tracker."""

    def __init__(self, tracker: _Tracker, key: str, *args: Any) -> None:
        super().__init__(*args)
        self.tracker, self.key = tracker, key

    async def _on_answer(self, answer: Membership) -> None:
        await super()._on_answer(answer)
        self.tracker.observe(self.key, self._epoch_of)

    def _epoch_of(self, key: str) -> int | None:
        m = self.members.get(key)
        return None if m is None else m.epoch


class _Engine:
    def __init__(self, key: str, role: str, epoch: int, peers: PeerDirectory, pool: _SimPoolWatch) -> None:
        self.key, self.role, self.epoch = key, role, epoch
        self.peers, self.pool = peers, pool
        self.state = "up"  # up | crashed | hung
        self.dead: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.closed = False
        self.task: asyncio.Task[Any] | None = None
        self.admitted = 0


class SimHost:
    """Many simulated engines in one process (an async actor)."""

    def __init__(
        self, engines_per_node: int, tp: int, layout: dict[str, Any], remote_timeout_s: float
    ) -> None:
        self.engines_per_node = engines_per_node
        self.tp = tp
        self.layout = KVLayout(**layout)
        self.remote_timeout_s = remote_timeout_s
        self.engines: dict[str, _Engine] = {}
        self.tracker = _Tracker()
        self.crashed_at: dict[str, float] = {}
        self.lookups = 0  # requests whose P the D's view did not know yet
        self._template: tuple[EngineDesc, MemoryDesc] | None = None

    def _descs(self) -> tuple[EngineDesc, MemoryDesc]:
        """One real tcp agent's descriptors, cloned for every engine of this host."""
        if self._template is None:
            import torch

            from moriio_ray.transfer import create_agent

            agent = create_agent(TransferConfig(backend="tcp"), f"sim-template-{id(self)}")
            self._template = (agent.engine_desc(), agent.register(torch.zeros(16)))
        return self._template

    def _info(self, key: str, role: str, epoch: int, bundle_index: int) -> WorkerInfo:
        engine, mem = self._descs()
        node_id = f"{bundle_index // self.engines_per_node:0{NODE_ID_HEX}x}"
        lay = self.layout
        heads = lay.num_kv_heads // self.tp
        ranks = []
        for r in range(self.tp if self.tp > 1 else 0):
            rank_key = key if r == 0 else f"{key}:rank{r}"
            rank_layout = msgspec.structs.replace(
                lay, num_kv_heads=heads, kv_head_start=r * heads, total_kv_heads=lay.num_kv_heads
            )
            ranks.append(
                RankDesc(
                    rank=r,
                    engine_desc=msgspec.structs.replace(engine, key=rank_key, epoch=epoch, node_id=node_id),
                    kv_mem=msgspec.structs.replace(
                        mem, engine_key=rank_key, epoch=epoch, num_bytes=rank_layout.total_bytes
                    ),
                    layout=rank_layout,
                )
            )
        return WorkerInfo(
            key=key,
            role=Role(role),
            epoch=epoch,
            # pid: the slot's bundle, which tells the callers this engine's host
            engine_desc=msgspec.structs.replace(
                engine, key=key, epoch=epoch, node_id=node_id, pid=bundle_index
            ),
            kv_mem=msgspec.structs.replace(mem, engine_key=key, epoch=epoch, num_bytes=lay.total_bytes),
            layout=lay,
            max_model_len=8192,
            vocab_size=128256,
            same_host_only=False,
            ranks=ranks,
        )

    # -- what the coordinator calls (``SimHandle``: the engine's key first) ----------------------

    async def register(
        self, key: str, role: str, epoch: int, bundle_index: int, coordinator: Any
    ) -> WorkerInfo:
        """Start a simulated engine (``ready``): its descriptors, and its pool watch running."""
        old = self.engines.pop(key, None)
        if old is not None:
            self._stop(old)
        info = self._info(key, role, epoch, bundle_index)
        peers = PeerDirectory(NullAgent(key), coordinator, self.remote_timeout_s)  # type: ignore[arg-type]
        pool = _SimPoolWatch(self.tracker, key, coordinator, peers, role, self.remote_timeout_s)
        engine = _Engine(key, role, epoch, peers, pool)
        engine.task = asyncio.ensure_future(pool.run(lambda: engine.closed))
        self.engines[key] = engine
        return info

    async def check_health(self, key: str) -> bool:
        engine = self.engines.get(key)
        if engine is None or engine.state == "crashed":
            raise RuntimeError(f"simulated engine {key} crashed")
        if engine.state == "hung":
            await asyncio.sleep(3600)
        return True

    async def until_death(self, key: str) -> None:
        """The coordinator's death watch: fails as Ray fails a call to an actor that died."""
        engine = self.engines.get(key)
        if engine is None:
            raise ray.exceptions.ActorDiedError()
        await engine.dead

    async def stats(self, key: str) -> dict[str, Any]:
        engine = self.engines[key]
        return {"key": key, "role": engine.role, "epoch": engine.epoch, "admitted": engine.admitted}

    async def shutdown(self, key: str) -> None:
        await self.drop(key)

    async def drop(self, key: str) -> None:
        engine = self.engines.pop(key, None)
        if engine is not None:
            self._stop(engine)

    def _stop(self, engine: _Engine) -> None:
        engine.closed = True
        if not engine.dead.done():  # killed: its death watch fails
            engine.dead.set_exception(ray.exceptions.ActorDiedError())
        if engine.task is not None:
            engine.task.cancel()

    # -- what the bench and the callers call ----------------------------------------------------

    async def crash(self, key: str, how: str = "crashed") -> float:
        """``crashed``: the engine dies (its death watch fails, its pings fail); ``hung``: it never
        answers again. Returns when."""
        engine = self.engines[key]
        engine.state = how
        if how == "crashed":
            engine.dead.set_exception(ray.exceptions.ActorDiedError())
        return time.time()

    async def track(self, subjects: list[Subject]) -> None:
        self.tracker.subjects.update(subjects)

    async def admit(self, batch: list[tuple[str, int, str, int]]) -> int:
        """Requests routed here, as (P key, P epoch, D key, D epoch) with D on this host: D takes
        each unless it is dead or of another epoch. A D finds its P in its view of the pool; a P
        it does not know yet (its view lags) it asks the coordinator about, as the worker's peer
        directory does. (No connect is simulated: a real D connects once per P, in its own
        process; here 250 engines share one.) Returns how many it refused."""
        refused = 0
        for p_key, p_epoch, d_key, d_epoch in batch:
            engine = self.engines.get(d_key)
            if engine is None or engine.epoch != d_epoch or engine.state != "up":
                refused += 1
                continue
            engine.admitted += 1
            known = engine.pool.members.get(p_key)
            if known is None or known.epoch != p_epoch:
                self.lookups += 1
                with contextlib.suppress(Exception):  # a P that died: the caller's retry, not simulated
                    await engine.peers.coordinator.lookup.remote(p_key)
        return refused

    async def report(self, _reset: bool = False) -> dict[str, Any]:
        return {
            "reached": self.tracker.report(),
            "engines": len(self.engines),
            "lookups": self.lookups,
            **usage(),
        }


class SimCallers:
    """Many callers in one process, each a router kept current by its own membership watch,
    routing ``rate`` requests a second between them (a request holds its P and D for
    ``service_s``). D's host is told of each request, in batches."""

    def __init__(
        self, prefix: str, count: int, coordinator: Any, hosts: list[Any], remote_timeout_s: float
    ) -> None:
        self.tracker = _Tracker()
        self.routers = [Router(seed=i) for i in range(count)]
        self.names = [f"{prefix}-{i}" for i in range(count)]
        self.watches = [
            MembershipWatch(coordinator, r, remote_timeout_s, self._observer(name, r))
            for name, r in zip(self.names, self.routers, strict=True)
        ]
        self.hosts = hosts
        self.route_ns: list[int] = []
        self.routed = 0
        self.refused = 0
        self.failed = 0
        self._pending: dict[int, list[tuple[str, int, str, int]]] = defaultdict(list)
        self._tasks: list[asyncio.Task[Any]] = []

    def _observer(self, name: str, router: Router) -> Any:
        def epoch_of(key: str) -> int | None:
            m = router.find(key)
            return None if m is None else m.epoch

        async def observe(_answer: Membership) -> None:
            self.tracker.observe(name, epoch_of)

        return observe

    async def start(self, rate: float, service_s: float, tick_s: float = 0.05) -> None:
        for w in self.watches:
            await w.refresh()
            w.ensure()
        self._tasks = [
            asyncio.ensure_future(self._route(rate, service_s, tick_s)),
            asyncio.ensure_future(self._flush(0.2)),
        ]

    async def _route(self, rate: float, service_s: float, tick_s: float) -> None:
        """Route ``rate`` requests a second over all this process's callers, round robin."""
        held: deque[tuple[float, Router, Any, Any]] = deque()
        owed = 0.0
        turn = 0
        rng = random.Random(0)
        while True:
            await asyncio.sleep(tick_s)
            now = time.perf_counter()
            while held and held[0][0] <= now:
                _, router, p, d = held.popleft()
                router.release(p, 1)
                router.release(d, 1)
            owed += rate * tick_s
            for _ in range(int(owed)):
                router = self.routers[turn % len(self.routers)]
                turn += 1
                t0 = time.perf_counter_ns()
                try:
                    p = router.pick("prefill")
                    d = router.pick_decode_for(p)
                except Exception:
                    self.failed += 1
                    continue
                router.acquire(p, 1)
                router.acquire(d, 1)
                dt = time.perf_counter_ns() - t0
                if len(self.route_ns) < SAMPLES or rng.random() < 0.01:
                    self.route_ns.append(dt)
                self.routed += 1
                held.append((now + service_s, router, p, d))
                host = d.info.engine_desc.pid % len(self.hosts)  # (see SimHost._info)
                self._pending[host].append((p.key, p.epoch, d.key, d.epoch))
            owed -= int(owed)

    async def _flush(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            batches, self._pending = self._pending, defaultdict(list)
            answers = await asyncio.gather(
                *(self.hosts[h].admit.remote(b) for h, b in batches.items()), return_exceptions=True
            )
            self.refused += sum(a for a in answers if isinstance(a, int))

    async def track(self, subjects: list[Subject]) -> None:
        self.tracker.subjects.update(subjects)
        for w in self.watches:
            assert w.on_update is not None
            await w.on_update(Membership(version=w.view.version))

    async def report(self, reset_samples: bool = True) -> dict[str, Any]:
        samples = self.route_ns
        if reset_samples:
            self.route_ns = []
        return {
            "reached": self.tracker.report(),
            "route_ns": samples,
            "routed": self.routed,
            "refused": self.refused,
            "failed": self.failed,
            **usage(),
        }
