"""What every worker has: its engine, agent, engine loop, peers, request table and output streams.

``WorkerCore`` also routes each step's outputs (``on_outputs``: a prefill's result to the call
waiting for it, tokens to their caller's stream), aborts requests, quarantines blocks that a late
transfer may still write, and notices callers that are gone. The role parts (``PrefillSide``,
``DecodeSide``) and the actor shell (``EngineWorker``) are built on it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from moriio_ray import env
from moriio_ray.config import PipelineConfig
from moriio_ray.engine.engine import Engine
from moriio_ray.engine.outputs import StepOutput
from moriio_ray.errors import ConfigError, DeadlineExceeded, EngineFailed, MoriioRayError, RequestCancelled
from moriio_ray.protocol import detached
from moriio_ray.protocol.messages import GenRequest, RankDesc, RequestOutput, Role, error_from
from moriio_ray.transfer import create_agent
from moriio_ray.worker.engine_loop import EngineLoop
from moriio_ray.worker.outputs import STREAM_PERIOD_S, OutputHub
from moriio_ray.worker.peers import PeerDirectory
from moriio_ray.worker.pool_watch import PoolWatch
from moriio_ray.worker.quarantine import Quarantine
from moriio_ray.worker.ranks import close_group, open_group
from moriio_ray.worker.requests import RequestTable, WorkerRequest

log = logging.getLogger(__name__)


class WorkerCore:
    """One engine and its agent (asyncio thread, except where a method says otherwise)."""

    def __init__(
        self,
        config: PipelineConfig,
        role: Role,
        key: str,
        *,
        epoch: int,
        token: bytes | None,
        coordinator: Any,
        ranks: list[Any] | None = None,
    ) -> None:
        self.config = config
        self.role = role
        self.key = key
        self.epoch = epoch
        self.coordinator = coordinator
        self.ranks = list(ranks or [])
        logging.getLogger("moriio_ray").setLevel(env.log_level())
        _prepare_device(config, role)
        if config.transfer.backend == "shm":
            # A worker killed with SIGKILL leaves its segments behind; its replacement (same node)
            # removes every segment whose owner process is gone.
            from moriio_ray.transfer.shm_segment import sweep_stale_segments

            swept = sweep_stale_segments()
            if swept:
                log.warning("removed %d shared-memory segments of dead workers", len(swept))
        self.agent = create_agent(config.transfer, key, epoch=epoch, token=token)
        # tensor parallelism: this worker is rank 0 of a group; ``ranks`` are the others' actors
        self.group, tp = open_group(config, role, ranks)
        self.engine = Engine(
            config.model,
            config.engine,
            role=role.value,
            agent=self.agent,
            lease_grace_s=config.transfer.lease_grace_s,
            lease_s=config.transfer.kv_lease_s,
            cuda_graphs=config.engine.cuda_graphs,
            tp=tp,
        )
        if self.engine.kv_mem is None:
            raise ConfigError("engine: the KV cache was not registered with the transfer agent")
        self.peers = PeerDirectory(
            self.agent,
            coordinator,
            config.runtime.remote_timeout_s,
            self.engine.layout,
            on_lost=self.group.lost if self.group is not None else None,
        )
        self.table = RequestTable(mark_ttl_s=config.runtime.remote_timeout_s)
        self.hub = OutputHub()
        self.counters: dict[str, int] = {
            "requests": 0,
            "transfers": 0,
            "transfer_bytes": 0,
            "transfer_failures": 0,
            "recomputes": 0,
            "cancelled": 0,
        }
        self._loop: EngineLoop | None = None
        self._background: set[asyncio.Future[Any]] = set()
        # engine ids whose blocks a late transfer may still write
        self.quarantine = Quarantine(self._free, self.spawn)
        self._closed = False
        self.pool: PoolWatch | None = None  # the membership's watch (``watch_coordinator``)

    @property
    def loop(self) -> EngineLoop:
        if self._loop is None:
            self._loop = EngineLoop(self.engine, asyncio.get_running_loop(), self.on_outputs, self.on_fault)
            self.spawn(self._watch_callers())
        return self._loop

    def spawn(self, coro: Coroutine[Any, Any, Any], *, detach: bool = False) -> asyncio.Task[Any]:
        """Run ``coro`` in the background; it is kept alive and its failure logged. ``detach``:
        outside the current request's Ray task lineage (see ``protocol/detached.py``)."""
        task = detached.spawn(coro) if detach else asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- outputs (asyncio thread, once per engine step) -----------------------------------------

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            rec = self.table.by_engine(out.request_id)
            if rec is None:
                continue  # aborted meanwhile
            first = rec.prefill_out
            if out.error is not None:  # this request failed in the engine (which goes on)
                self.fail(rec, error_from(*out.error))
            elif first is not None:  # the prefill's output answers the call waiting for it
                rec.prefill_out = None  # (colocated: the later outputs go to the stream)
                if not first.done():
                    first.set_result(out)
            elif rec.caller is not None:
                item = RequestOutput.of_step(rec.request_id, out)
                item.start, rec.start = rec.start, None  # D: its hand-over timings, on the first
                self.hub.push(rec.caller, item)
            if out.finished and rec.caller is not None:
                self.table.close(rec)

    def on_fault(self, exc: BaseException) -> None:
        """The engine itself failed: every request on this worker ends with EngineFailed (none
        hangs), and the coordinator's health check replaces the worker."""
        failure = EngineFailed(f"the engine of {self.key} failed ({type(exc).__name__}); retry the request")
        for rec in self.table.records():
            self.fail(rec, failure)

    def fail(self, rec: WorkerRequest, exc: BaseException) -> None:
        """End a request with a typed error: through the call waiting for its prefill, or on its
        caller's output stream."""
        first, rec.prefill_out = rec.prefill_out, None
        if first is not None:
            if not first.done():
                first.set_exception(exc)
            return  # the call that waited for it ends the request (and closes its record)
        self.table.close(rec)
        if rec.caller is not None:
            name = type(exc).__name__ if isinstance(exc, MoriioRayError) else "MoriioRayError"
            self.hub.push(rec.caller, RequestOutput(rec.request_id, [], error=(name, str(exc))))

    async def outputs(self, caller: str) -> AsyncIterator[bytes]:
        async for item in self.hub.stream(caller, STREAM_PERIOD_S, self.abort_caller):
            yield item

    # -- ending requests ------------------------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        """Cancel a request here: its blocks, lease and reservation are freed at once, except blocks
        that a transfer may still write (quarantined until it has ended); a request still on its way
        is refused when it arrives (a cancel mark)."""
        rec = self.table.cancel(request_id)
        if rec is not None:
            self.counters["cancelled"] += 1
            if rec.prefill_out is not None and not rec.prefill_out.done():
                rec.prefill_out.set_exception(RequestCancelled(f"request {request_id} was cancelled"))
            if rec.task is not None and not rec.task.done():
                rec.task.cancel()  # the call serving it cleans up (quarantine included)
                return
            self.table.close(rec)
            if self._hold_reservation(rec):
                return
            engine_id = rec.engine_id
        else:
            engine_id = request_id
        if engine_id in self.quarantine:
            return  # a late abort: the quarantine frees these blocks once the transfer has ended
        await self.loop.call_now(lambda: self.engine.abort(engine_id))

    def pushes_ended(self, request_id: str) -> None:
        """WRITE (D): no push into this request's reservation can land any more (P's result or its
        notice came, or no P was asked): its blocks may be freed as soon as the request ends."""
        rec = self.table.get(request_id)
        if rec is not None:
            rec.pushes_ended = True
        self.quarantine.pushes_ended(request_id)

    def _hold_reservation(self, rec: WorkerRequest) -> bool:
        """WRITE (D): keep an ended request's reserved blocks out of use while P's one-sided pushes
        may still land in them; True if held."""
        res, rec.reservation = rec.reservation, None
        if res is None or rec.pushes_ended:
            return False
        until_unix = res.deadline_unix + self.config.transfer.lease_grace_s
        self.quarantine.hold_push(rec.request_id, rec.engine_id, until_unix)
        return True

    def abort_caller(self, caller: str) -> None:
        """A caller closed its stream or is gone: abort each of its requests."""
        recs = self.table.of_caller(caller)
        if recs:
            log.info("caller %s left; aborting its %d requests", caller, len(recs))
        for rec in recs:
            self.spawn(self.abort(rec.request_id))

    def watch_coordinator(self) -> None:
        """Follow the pool's membership from now on (once): see ``PoolWatch``. Ends the pool when
        the coordinator is gone for good (its driver died, or it was killed without restart)."""
        if self.coordinator is not None and self.pool is None:
            self.pool = PoolWatch(
                self.coordinator, self.peers, self.role.value, self.config.runtime.remote_timeout_s
            )
            self.spawn(self._watch_pool(self.pool), detach=True)

    async def _watch_pool(self, pool: PoolWatch) -> None:
        if not await pool.run(lambda: self._closed):
            return
        log.error("the coordinator of %s is gone for good: ending its pool", self.config.name)
        await asyncio.to_thread(_end_pool, self.config.name, [*self.ranks])

    async def _watch_callers(self) -> None:
        while not self._closed:
            await asyncio.sleep(STREAM_PERIOD_S)
            for caller in self.hub.gone(self.table.callers()):
                log.warning("caller %s opened no output stream for a while: it is gone", caller)
                self.abort_caller(caller)

    def discard(self, rec: WorkerRequest) -> None:
        """Forget a request that ends here without a stream end: free whatever the engine holds
        (a WRITE reservation that P may still push into, once the pushes have ended)."""
        self.table.close(rec)
        if not self._hold_reservation(rec):
            self._free(rec.engine_id)

    def _free(self, engine_id: str) -> None:
        self.loop.post(lambda: self.engine.abort(engine_id))

    def rank0(self) -> RankDesc:
        """This worker's own rank: its agent, KV region and layout."""
        assert self.engine.kv_mem is not None
        return RankDesc(
            rank=0, engine_desc=self.agent.engine_desc(), kv_mem=self.engine.kv_mem, layout=self.engine.layout
        )

    async def reserve_blocks(
        self, req: GenRequest, engine_id: str, deadline_s: float
    ) -> tuple[list[int], int]:
        """Reserve blocks for ``req``; wait for the engine to free some, up to ``deadline_s``
        (monotonic). (the blocks, how many of the first ones hold the prompt's KV already)"""

        def reserve() -> tuple[list[int], int] | None:
            e = self.engine
            blocks = e.reserve(engine_id, req.prompt_token_ids, req.params, sample_offset=req.sample_offset)
            return None if blocks is None else (blocks, e.cached_blocks(engine_id))

        while True:
            reserved = await self.loop.call_now(reserve)
            if reserved is not None:
                return reserved
            if time.monotonic() >= deadline_s:
                raise DeadlineExceeded(
                    f"{self.key}: no free KV blocks for {req.request_id} before its deadline"
                )
            await self.loop.next_step()

    # -- lifecycle ------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is not None:
            self._loop.stop()
        if self.group is not None:
            close_group(self.engine)
        self.agent.close()


def _prepare_device(config: PipelineConfig, role: Role) -> None:
    """CPU engines use the threads Ray gave them; cuda_ipc engines pick their GPU among all visible."""
    import torch

    if config.transfer.backend == "cuda_ipc":
        from moriio_ray.transfer.cuda_devices import select_device

        select_device()
    if config.engine.device == "cpu" or not torch.cuda.is_available():
        role_cfg = getattr(config.pool, role.value)
        torch.set_num_threads(max(1, int(role_cfg.num_cpus or 1)))


def _end_pool(pipeline: str, ranks: list[Any]) -> None:
    """Remove the pipeline's placement group (which ends every worker in it, this one too)."""
    import ray
    from ray.util.placement_group import get_placement_group, remove_placement_group

    from moriio_ray.protocol.pool_state import drop, placement_group_name

    for actor in ranks:
        ray.kill(actor, no_restart=True)
    try:
        drop(pipeline)
        remove_placement_group(get_placement_group(placement_group_name(pipeline)))
    except Exception as exc:  # already removed by another worker of the pool
        log.info("placement group of %s: %r", pipeline, exc)
    time.sleep(5.0)  # the removal ends this process; should it not have, end it here
    os._exit(0)
