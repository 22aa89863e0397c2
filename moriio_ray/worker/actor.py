"""The engine worker: a plain class (tests drive it without Ray) and its Ray actor shell.

Its request methods delegate to the parts it composes: ``WorkerCore`` (engine, agent, loop,
requests, output streams), ``PrefillSide`` on a prefill worker, ``DecodeSide`` on a decode worker.
What it does itself is the lifecycle: describing the worker once its graphs are captured
(``ready``), health (``check_health``), the stats it reports, and the ``call`` extension point.
Tokens never travel as the return value of a request's call: they go to the caller's output
stream (``outputs``), one message per engine step for all of that caller's requests.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from moriio_ray import metrics
from moriio_ray.config import PipelineConfig
from moriio_ray.errors import InvalidRequest
from moriio_ray.protocol import wire
from moriio_ray.protocol.deadline import deadline
from moriio_ray.protocol.messages import (
    GenRequest,
    Handoff,
    PeerRef,
    RequestOutput,
    Role,
    WorkerInfo,
)

if TYPE_CHECKING:  # the heavy parts (engine, torch, agent) load in __init__, in the worker's process:
    from moriio_ray.worker.decode import DecodeSide  # none of them
    from moriio_ray.worker.prefill import PrefillSide


class EngineWorker:
    """One engine and its agent, in one of three roles. Every method is safe to call concurrently."""

    def __init__(
        self,
        config: PipelineConfig,
        role: str,
        key: str,
        *,
        epoch: int = 1,
        token: bytes | None = None,
        coordinator: Any = None,
        ranks: list[Any] | None = None,
    ) -> None:
        from moriio_ray.worker.core import WorkerCore
        from moriio_ray.worker.decode import DecodeSide
        from moriio_ray.worker.prefill import PrefillSide

        self.role = Role(role)
        # ranks: the RankWorker actors of a tensor-parallel engine's ranks 1.. (this worker is rank 0)
        self.core = WorkerCore(
            config, self.role, key, epoch=epoch, token=token, coordinator=coordinator, ranks=ranks
        )
        self._prefill: PrefillSide | None = PrefillSide(self.core) if self.role is Role.PREFILL else None
        self._decode: DecodeSide | None = DecodeSide(self.core) if self.role is Role.DECODE else None
        self._info: WorkerInfo | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    async def ready(self) -> WorkerInfo:
        """Start the engine loop, capture the decode CUDA graphs, and describe this worker."""
        c = self.core
        await c.loop.call(c.engine.capture_graphs)
        # every rank's descriptors and KV-head range, rank 0 first (none at TP = 1)
        ranks = [c.rank0(), *(await c.group.descs())] if c.group is not None else []
        self._info = WorkerInfo(
            key=c.key,
            role=self.role,
            epoch=c.epoch,
            engine_desc=c.agent.engine_desc(),
            kv_mem=c.engine.kv_mem,
            layout=c.engine.layout,
            # the longest request this engine can hold: the model's length, or its KV blocks' if fewer
            max_model_len=min(c.engine.max_model_len, c.engine.allocator.num_blocks * c.engine.block_size),
            vocab_size=c.engine.args.vocab_size,
            same_host_only=c.agent.same_host_only,
            ranks=ranks,
        )
        c.watch_coordinator()
        return self._info

    async def info(self) -> WorkerInfo:
        """What ``ready`` returned (a restarted coordinator takes this worker back with it)."""
        if self._info is None:
            raise InvalidRequest(f"worker {self.core.key} is not ready yet")
        return self._info

    async def check_health(self) -> bool:
        """True, or raise (the coordinator then replaces this worker): when the engine loop failed,
        or when its thread has been inside one step or call for longer than
        ``runtime.remote_timeout_s`` (hung: every call waiting on it would miss its deadline)."""
        loop, limit_s = self.core.loop, self.core.config.runtime.remote_timeout_s
        if loop.error is not None:
            raise RuntimeError(f"engine loop of {self.core.key} failed: {loop.error!r}")
        stalled_s = loop.stalled_s()
        if stalled_s > limit_s:
            raise RuntimeError(
                f"the engine thread of {self.core.key} has been in one step or call for {stalled_s:.1f} s, "
                f"more than runtime.remote_timeout_s ({limit_s} s): it is hung"
            )
        return True

    async def stats(self) -> dict[str, Any]:
        c = self.core
        stats: dict[str, Any] = await c.loop.call(c.engine.stats)
        cache: dict[str, int] = await c.loop.call(c.engine.prefix_cache_stats)
        metrics.set_blocks(stats["num_free_blocks"], stats["num_leased_blocks"], worker=c.key, role=self.role)
        metrics.set_prefix_cache(
            cache["num_hit_tokens"],
            cache["num_queried_tokens"],
            cache["num_cached_blocks"],
            worker=c.key,
            role=self.role,
        )
        reserved = sum(rec.reservation is not None for rec in c.table.records())
        return {
            "key": c.key,
            "pid": os.getpid(),  # which process is this worker (CPU accounting, profilers)
            "role": self.role.value,
            "epoch": c.epoch,
            "device": str(c.engine.device),
            "tensor_parallel_size": c.engine.tp.size,
            "num_graphs": len(c.engine.graphs.graphs) if c.engine.graphs is not None else 0,
            "num_graph_replays": c.engine.graphs.num_replays if c.engine.graphs is not None else 0,
            "live_requests": len(c.table),
            "pending_reservations": reserved,
            "quarantined_requests": len(c.quarantine),
            "expired_leases": c.loop.expired_leases,
            **stats,
            "prefix_cache": cache,
            **c.counters,
        }

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(core, *args)`` on this worker's event loop, ``core`` being its ``WorkerCore``
        (awaited if it returns an awaitable); return its result.

        An extension point in the manner of vLLM's ``collective_rpc``: tests install their fault
        injection through it (tests/faults.py), so that no production class carries a test hook.
        ``fn`` travels pickled: a function of a module the worker can import. Whoever can call this
        actor can already run any code in the cluster; this adds no reach."""
        result = fn(self.core, *args)
        return await result if inspect.isawaitable(result) else result

    async def until_death(self) -> None:
        """Never returns: the coordinator's call fails when this actor dies (its death watch)."""
        await asyncio.Event().wait()

    async def shutdown(self) -> None:
        await self.core.shutdown()

    # -- every role -----------------------------------------------------------------------------

    async def outputs(self, caller: str) -> AsyncIterator[bytes]:
        """The caller's output stream (msgpack ``OutputBatch`` items); ends after a period, and
        the caller opens the next one."""
        async for item in self.core.outputs(caller):
            yield item

    async def abort(self, request_id: str, push_to: PeerRef | None = None) -> None:
        """Cancel a request: free its blocks, lease and reservation at once, wherever it is, except
        what a transfer may still use (a lease D is reading, blocks a late transfer may write: freed
        once it has ended). P in WRITE: ``push_to`` is the D it pushes to."""
        if self._prefill is not None:
            await self._prefill.abort(request_id, push_to)
        else:
            await self.core.abort(request_id)

    # -- colocated ------------------------------------------------------------------------------

    async def generate(self, packed: bytes, caller: str) -> bytes:
        """Colocated: prefill and return the first token (a packed ``RequestOutput``; ``packed``, a
        packed ``GenRequest``: ``protocol/wire.py``); the later tokens go to ``caller``'s output
        stream (the first one answers this call: one hop less before the first token)."""
        req: GenRequest = wire.unpack(packed, GenRequest)
        c = self._role(Role.COLOCATED).core
        rec = c.table.open(req.request_id, caller)
        c.counters["requests"] += 1
        rec.task = asyncio.current_task()
        rec.prefill_out = first = asyncio.get_running_loop().create_future()
        try:
            await c.loop.call_now(
                lambda: c.engine.add_request(
                    req.request_id, req.prompt_token_ids, req.params, sample_offset=req.sample_offset
                )
            )
            out = await deadline(first, c.config.runtime.remote_timeout_s, f"the prefill of {req.request_id}")
        except BaseException:
            c.discard(rec)
            raise
        finally:
            rec.task = None
        return wire.pack(RequestOutput.of_step(req.request_id, out))

    # -- prefill --------------------------------------------------------------------------------

    async def prefill(self, packed: bytes, to: PeerRef | None = None, caller: str = "") -> bytes:
        """READ: prefill, lease the prompt's blocks, hand them to ``to`` (D, which streams the later
        tokens to ``caller``) and return the handle: the first token (a packed ``KVHandle``)."""
        return wire.pack(await self._side_p().prefill(wire.unpack(packed, GenRequest), to, caller))

    async def prefill_push(self, packed: bytes, to: PeerRef, caller: str = "") -> bytes:
        """WRITE: reserve blocks on ``to`` (D), prefill while pushing each layer into them, and hand
        the result to D, which streams the later tokens to ``caller`` (a packed ``PushResult``)."""
        return wire.pack(await self._side_p().prefill_push(wire.unpack(packed, GenRequest), to, caller))

    # -- decode ---------------------------------------------------------------------------------

    async def reserve(self, packed: bytes, caller: str | None = None) -> bytes:
        """WRITE (from P): reserve blocks for P to push the prompt's KV into (a packed
        ``Reservation``)."""
        return wire.pack(await self._side_d().reserve(wire.unpack(packed, GenRequest), caller))

    async def deliver(self, items: list[tuple[bytes, bytes, str]]) -> list[str | None]:
        """P's hand-overs (each a packed request, a packed ``Handoff`` and the caller whose stream
        gets its tokens; ``worker/handovers.py`` batches them): bring the KV in and decode. Returns
        once no item's blocks on P are needed any more (P frees its leases then), one outcome per
        item: ``None``, or why D refused it or it failed."""
        side = self._side_d()

        async def one(packed: bytes, source: bytes, caller: str) -> str | None:
            try:
                await side.deliver(wire.unpack(packed, GenRequest), wire.unpack(source, Handoff), caller)
            except Exception as exc:
                return repr(exc)
            return None

        if len(items) == 1:  # (no gather: the request's task is spawned within this call's first step)
            return [await one(*items[0])]
        return list(await asyncio.gather(*(one(*item) for item in items)))

    async def pushes_ended(self, request_id: str) -> None:
        """WRITE: P's pushes of a request that ended early have ended: nothing more lands in its
        reservation, whose blocks may be freed."""
        self._side_d().core.pushes_ended(request_id)

    # -- role checks ----------------------------------------------------------------------------

    def _role(self, role: Role) -> EngineWorker:
        if self.role is not role:
            raise InvalidRequest(f"worker {self.core.key} is a {self.role.value} worker, not {role.value}")
        return self

    def _side_p(self) -> PrefillSide:
        if self._prefill is None:
            raise InvalidRequest(f"worker {self.core.key} is a {self.role.value} worker, not prefill")
        return self._prefill

    def _side_d(self) -> DecodeSide:
        if self._decode is None:
            raise InvalidRequest(f"worker {self.core.key} is a {self.role.value} worker, not decode")
        return self._decode


def make_actor_class() -> Any:
    """The Ray actor of EngineWorker (built lazily so that importing this module needs no Ray)."""
    import ray

    return ray.remote(EngineWorker)
