"""The coordinator: owns the worker pools, their descriptors and their liveness.

A named async actor (create-or-get) in namespace ``moriio_ray``. It creates the workers in one
placement group (one bundle per engine), keeps each worker's descriptors as msgpack bytes inside its
``Member``, and publishes a versioned membership that callers and workers long-poll (``watch``: the
change since the watcher's version, packed once per version; ``changes``). Liveness (``liveness``)
sees a crash at once through a death watch and a silent worker through pings; a death bumps that
worker's epoch and publishes its removal, which every watcher receives (a peer's in-flight transfers
then fail with PeerLost), and a replacement starts in the same bundle. A tensor-parallel engine is one member
whose bundle holds all its ranks' actors (``engine_group``): they are started, pinged, killed and
replaced together.

It survives its own death: the workers and the placement group are detached and named, and Ray
restarts it; it then takes the pool back (``recovery``). Callers and workers keep serving on the
membership they hold while it is down. Workers end their pool once it is gone for good
(``WorkerCore``'s watch), so a pipeline whose driver died leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from moriio_ray import env
from moriio_ray.config import PipelineConfig, RoleConfig
from moriio_ray.coordinator.changes import ChangeLog
from moriio_ray.coordinator.engine_group import bundle, check_node_fit, check_tp_sizes, kill_all, start_ranks
from moriio_ray.coordinator.liveness import Liveness
from moriio_ray.coordinator.recovery import Recovery, Slot
from moriio_ray.errors import CapacityError, DeadlineExceeded
from moriio_ray.protocol import pool_state as state
from moriio_ray.protocol.membership import pack
from moriio_ray.protocol.messages import Member, Membership, Role, WorkerInfo

log = logging.getLogger(__name__)
PACKED_ANSWERS = 64  # packed membership answers kept (one per version a watcher starts from)
WORKER_STATS_TIMEOUT_S = 10.0  # a worker that does not answer is listed with its error

NAMESPACE = state.NAMESPACE  # (tests and callers import it from here)


def coordinator_name(name: str) -> str:
    return f"coordinator:{name}"


class Coordinator(Liveness, Recovery):
    """See the module docstring. All methods are async; the actor runs them on one event loop."""

    def __init__(self, config: PipelineConfig, token: bytes | None = None) -> None:
        self.config = config
        # the cluster token every worker's agent requires of its peers: the one the launching
        # process was given (MORIIO_RAY_CLUSTER_TOKEN), else a fresh one
        self.token = token if token is not None else secrets.token_bytes(32)
        logging.getLogger("moriio_ray").setLevel(env.log_level())
        self.version = 0
        self.slots: list[Slot] = []
        self.pg: PlacementGroup | None = None
        self.deaths: list[dict[str, Any]] = []
        self._changed: asyncio.Event | None = None
        self.changes = ChangeLog()
        self._packed: dict[tuple[int, int], bytes] = {}  # (since, version) -> a packed answer
        self._started: asyncio.Task[None] | None = None
        self._health: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self.restarts = 0  # how many times Ray restarted this coordinator (its pool taken back)
        self._restarted = _restarted()  # this process is a restart: its pool is to be taken back

    # -- start ----------------------------------------------------------------------------------

    async def start(self) -> int:
        """Create the pool (once) and wait until every worker is ready; returns the membership version.

        A start that fails (no room for the placement group, a worker not ready within
        ``runtime.worker_start_timeout_s``) leaves nothing behind: no worker, no placement group.
        The next ``start`` tries again."""
        if self._started is None:
            stored = state.load(self.config.name) if self._restarted else None
            self._started = asyncio.ensure_future(self._recover(stored) if stored else self._start())
        started = self._started
        try:
            await asyncio.shield(started)
        except BaseException:
            if started.done() and self._started is started:
                self._started = None
            raise
        return self.version

    async def _start(self) -> None:
        self._changed = asyncio.Event()
        roles = self._role_slots()
        await self._place(roles)
        self.slots = roles
        # every slot's start ends (each bounded by worker_start_timeout_s) before a failure is
        # cleaned up, so that no worker is published after the pool was released
        results = await asyncio.gather(*(self._spawn(slot) for slot in self.slots), return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            self._release_pool()
            raise failure
        self._health = asyncio.ensure_future(self._health_loop())

    async def _place(self, roles: list[Slot]) -> None:
        """Reserve the pool's placement group: one bundle per engine (CapacityError if it cannot)."""
        check_tp_sizes(self.config)
        check_node_fit(self.config.pool, ray.nodes())
        bundles = [bundle(getattr(self.config.pool, s.role)) for s in roles]
        labels = [dict(getattr(self.config.pool, s.role).labels) for s in roles]
        kwargs: dict[str, Any] = {}
        if any(labels):
            kwargs["bundle_label_selector"] = labels
        # detached and named: the pool outlives this process, so that a restarted coordinator takes it back
        self.pg = placement_group(
            bundles,
            strategy=self.config.pool.placement_strategy,
            name=state.placement_group_name(self.config.name),
            lifetime="detached",
            **kwargs,
        )
        timeout_s = self.config.runtime.worker_start_timeout_s
        ready, _ = await asyncio.to_thread(ray.wait, [self.pg.ready()], timeout=timeout_s)
        if not ready:
            self._release_pool()
            raise CapacityError(
                f"runtime.worker_start_timeout_s: the placement group {bundles} (strategy "
                f"{self.config.pool.placement_strategy}) could not be scheduled within {timeout_s} s; "
                f"the cluster has {ray.available_resources()}"
            )

    def _release_pool(self) -> None:
        """Kill every worker of the pool and give its placement group back (a failed start)."""
        for slot in self.slots:
            self._kill([slot.member.actor] if slot.member is not None else [], slot.ranks)
            slot.member, slot.ranks = None, []
        self.slots = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        state.drop(self.config.name)

    def _role_slots(self) -> list[Slot]:
        pool = self.config.pool
        slots: list[Slot] = []
        for role in (Role.PREFILL.value, Role.DECODE.value, Role.COLOCATED.value):
            for i in range(getattr(pool, role).replicas):
                slots.append(Slot(role=role, index=i, bundle_index=len(slots)))
        return slots

    async def _spawn(self, slot: Slot) -> None:
        """Start the slot's worker at the next epoch and publish it once ready."""
        slot.starting = True
        slot.epoch += 1
        key = f"{self.config.name}-{slot.role}-{slot.index}"
        try:
            actor, ranks, info = await self._start_worker(slot, key)
        finally:
            slot.starting = False
        slot.ranks = ranks
        name = state.worker_name(self.config.name, key, slot.epoch)
        slot.member = Member.of(info, role=slot.role, epoch=slot.epoch, actor=actor, actor_name=name)
        slot.misses = 0
        self._bump(upserts=[slot.member])
        self._watch_death(slot)

    async def _start_worker(self, slot: Slot, key: str) -> tuple[Any, list[Any], WorkerInfo]:
        """The slot's worker actor (and its rank actors) in its bundle, once ready, with its
        descriptors; nothing is left running when it fails."""
        rc: RoleConfig = getattr(self.config.pool, slot.role)
        assert self.pg is not None
        options: dict[str, Any] = {
            "num_cpus": rc.num_cpus,
            "num_gpus": rc.num_gpus,
            "max_restarts": 0,  # we replace a dead worker ourselves, at a new epoch
            "max_concurrency": 4096,
            # outlives this process (a restarted coordinator finds it by name); shutdown ends it
            "lifetime": "detached",
            "name": state.worker_name(self.config.name, key, slot.epoch),
            "namespace": NAMESPACE,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=slot.bundle_index
            ),
        }
        if rc.resources:
            options["resources"] = dict(rc.resources)
        if self.config.transfer.backend == "cuda_ipc":
            from moriio_ray.transfer.cuda_devices import ray_actor_env

            options["runtime_env"] = {"env_vars": ray_actor_env()}
        from moriio_ray.worker.actor import make_actor_class  # the worker's code, not the coordinator's

        me = ray.get_runtime_context().current_actor
        ranks = start_ranks(self.config, slot.role, key, slot.epoch, self.token, options)
        actor = (
            make_actor_class()
            .options(**options)
            .remote(
                self.config, slot.role, key, epoch=slot.epoch, token=self.token, coordinator=me, ranks=ranks
            )
        )
        try:
            info: WorkerInfo = await asyncio.wait_for(
                actor.ready.remote(), self.config.runtime.worker_start_timeout_s
            )
        except asyncio.TimeoutError:
            self._kill([actor], ranks)
            raise DeadlineExceeded(
                f"runtime.worker_start_timeout_s: worker {key} was not ready within "
                f"{self.config.runtime.worker_start_timeout_s} s"
            ) from None
        except BaseException:
            self._kill([actor], ranks)
            raise
        return actor, ranks, info

    def _kill(self, workers: list[Any], ranks: list[Any]) -> None:
        """End an engine's actors at once (its worker, then its rank actors)."""
        kill_all([*workers, *ranks])

    # -- membership -----------------------------------------------------------------------------

    def _members(self) -> list[Member]:
        return [s.member for s in self.slots if s.member is not None]

    def _bump(self, upserts: Sequence[Member] = (), removed: Sequence[tuple[str, int]] = ()) -> None:
        """A new membership version: the members added or replaced, the (key, epoch) gone. Every
        long poll (callers' routers, workers' peers) answers with the change."""
        self.version += 1
        self.changes.record(self.version, list(upserts), list(removed))
        self._save()
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    async def _resume(self) -> None:
        """After Ray restarted this coordinator, the first call of any caller or worker takes the
        pool back (nobody calls ``start`` on a restart)."""
        if self._started is None and self._restarted:
            await self.start()

    async def get_membership(self, since_version: int = -1, timeout_s: float = 0.0) -> Membership:
        """The membership; with ``timeout_s`` > 0, wait that long for a version above
        ``since_version``. The answer is the change since that version when the log holds it."""
        await self._wait_change(since_version, timeout_s)
        return self.changes.answer(since_version, self.version, self._members)

    async def watch(self, since_version: int = -1, timeout_s: float = 0.0) -> bytes:
        """``get_membership`` packed (``protocol/membership.py``): what every watcher long-polls.
        All the watchers at one version get the same bytes, packed once per change."""
        await self._wait_change(since_version, timeout_s)
        key = (since_version, self.version)
        packed = self._packed.get(key)
        if packed is None:
            if len(self._packed) > PACKED_ANSWERS:
                self._packed.clear()
            packed = self._packed[key] = pack(self.changes.answer(since_version, self.version, self._members))
        return packed

    async def _wait_change(self, since_version: int, timeout_s: float) -> None:
        await self._resume()
        if self.version <= since_version and timeout_s > 0 and self._changed is not None:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass

    async def lookup(self, key: str) -> Member | None:
        await self._resume()
        return next((s.member for s in self.slots if s.member is not None and s.member.key == key), None)

    async def get_config(self) -> PipelineConfig:
        return self.config

    async def alive(self) -> int:
        """The membership version (the workers' check that their coordinator still exists)."""
        await self._resume()
        return self.version

    def _background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- stats and shutdown ---------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        await self._resume()
        members = self._members()
        results = await asyncio.gather(
            *(asyncio.wait_for(m.actor.stats.remote(), WORKER_STATS_TIMEOUT_S) for m in members),
            return_exceptions=True,
        )
        workers = {
            m.key: (r if not isinstance(r, BaseException) else {"error": repr(r)})
            for m, r in zip(members, results, strict=True)
        }
        return {
            "name": self.config.name,
            "mode": self.config.mode,
            "backend": self.config.transfer.backend,
            "version": self.version,
            "coordinator_node": ray.get_runtime_context().get_node_id(),
            "workers": workers,
            "deaths": list(self.deaths),
            "restarts": self.restarts,
            "starting": [f"{s.role}-{s.index}" for s in self.slots if s.starting],
        }

    async def shutdown(self) -> None:
        self._closing = True
        if self._health is not None:
            self._health.cancel()
        members = self._members()
        await asyncio.gather(
            *(asyncio.wait_for(m.actor.shutdown.remote(), 10.0) for m in members), return_exceptions=True
        )
        self._kill([m.actor for m in members], [r for s in self.slots for r in s.ranks])
        for s in self.slots:
            s.member, s.ranks = None, []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        state.drop(self.config.name)


def _restarted() -> bool:
    """Whether Ray restarted this actor (this is not its first process)."""
    return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def get_or_create(config: PipelineConfig, *, detached: bool) -> Any:
    """The coordinator actor of ``config.name``: the running one, or a new one."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = env.configured_cluster_token()  # read here: the launching process's environment
    actor_cls = ray.remote(Coordinator)
    # On the launching process's node: usually the head, which outlives worker nodes.
    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return actor_cls.options(
        scheduling_strategy=here,
        name=coordinator_name(config.name),
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached" if detached else None,
        num_cpus=0,
        max_concurrency=4096,
        max_restarts=-1,  # Ray restarts it; it takes its pool back (``_recover``)
    ).remote(config, token)


def get_existing(name: str) -> Any:
    """The running coordinator of ``name`` (ValueError if there is none)."""
    return ray.get_actor(coordinator_name(name), namespace=NAMESPACE)
