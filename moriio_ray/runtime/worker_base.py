"""What every engine worker has: its engine, agent, engine loop and peers; lifecycle, stats,
cancellation marks, quarantine and lease hand-back. The role methods are in ``worker.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from moriio_ray import env, metrics
from moriio_ray.config import PipelineConfig
from moriio_ray.engine.engine import Engine
from moriio_ray.errors import ConfigError, DeadlineExceeded, RequestCancelled
from moriio_ray.runtime.engine_loop import EngineLoop
from moriio_ray.runtime.mailbox import Mailbox
from moriio_ray.runtime.messages import (
    GenRequest,
    KVHandle,
    Member,
    PushResult,
    Reservation,
    Role,
    WorkerInfo,
)
from moriio_ray.runtime.peers import PeerDirectory
from moriio_ray.runtime.push import LayerPusher
from moriio_ray.transfer import create_agent
from moriio_ray.transfer.handle import Transfer

log = logging.getLogger(__name__)


class WorkerBase:
    """One engine and its agent. Every public method is safe to call concurrently (asyncio)."""

    def __init__(
        self,
        config: PipelineConfig,
        role: str,
        key: str,
        *,
        epoch: int = 1,
        token: bytes | None = None,
        coordinator: Any = None,
    ) -> None:
        self.config = config
        self.role = Role(role).value
        logging.getLogger("moriio_ray").setLevel(env.log_level())
        self.key = key
        self.epoch = epoch
        self.coordinator = coordinator
        _prepare_device(config, self.role)
        if config.transfer.backend == "shm":
            # A worker killed with SIGKILL leaves its segments behind; its replacement (same node)
            # removes every segment whose owner process is gone.
            from moriio_ray.transfer.shm_segment import sweep_stale_segments

            swept = sweep_stale_segments()
            if swept:
                log.warning("removed %d shared-memory segments of dead workers", len(swept))
        self.agent = create_agent(config.transfer, key, epoch=epoch, token=token)
        self.engine = Engine(
            config.model,
            config.engine,
            role=self.role,
            agent=self.agent,
            lease_grace_s=config.transfer.lease_grace_s,
            lease_s=config.transfer.kv_lease_s,
            # Eager decode in workers: on two H200s the decode worker on cuda:1 failed its lazy
            # CUDA-graph capture ("operation not permitted when stream is capturing"). The likely
            # cause, that the engine thread ran with cuda:0 current, is fixed in EngineLoop but not
            # yet verified on a GPU, so graphs stay off here until it is.
            cuda_graphs=False,
        )
        if self.engine.kv_mem is None:
            raise ConfigError("engine: the KV cache was not registered with the transfer agent")
        self.kv_mem = self.engine.kv_mem
        self.layout = self.engine.layout
        self.peers = PeerDirectory(self.agent, coordinator, config.runtime.remote_timeout_s)
        self._loop: EngineLoop | None = None
        self._pushers: dict[str, LayerPusher] = {}
        self._reservations: dict[str, Reservation] = {}
        self._quarantined: set[str] = set()
        self._cancelled: dict[str, float] = {}  # request id -> when a cancel arrived
        self.mailbox: Mailbox[KVHandle | PushResult] = Mailbox()
        self._background: set[asyncio.Future[None]] = set()
        self._closed = False
        self.counters: dict[str, float] = {
            "requests": 0,
            "transfers": 0,
            "transfer_bytes": 0,
            "transfer_failures": 0,
            "recomputes": 0,
            "cancelled": 0,
        }

    def _on_layer(self, layer: int, request_ids: list[str]) -> None:
        """Prefill workers: called by the engine after each layer's KV is written (WRITE mode)."""

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def loop(self) -> EngineLoop:
        if self._loop is None:
            self._loop = EngineLoop(self.engine, asyncio.get_running_loop())
            if self.role == Role.PREFILL.value:
                self.engine.set_layer_hook(self._on_layer)
        return self._loop

    async def ready(self) -> WorkerInfo:
        """Start the engine loop and publish this worker's descriptors."""
        _ = self.loop
        return WorkerInfo(
            key=self.key,
            role=self.role,
            epoch=self.epoch,
            node_id=self.agent.engine_desc().node_id,
            host=self.agent.engine_desc().host,
            pid=self.agent.engine_desc().pid,
            backend=self.agent.name,
            engine_desc=self.agent.engine_desc(),
            kv_mem=self.kv_mem,
            layout=self.layout,
            max_model_len=self.engine.max_model_len,
            num_blocks=self.layout.num_blocks,
            same_host_only=self.agent.same_host_only,
        )

    async def check_health(self) -> bool:
        if self._loop is not None and self._loop.error is not None:
            raise RuntimeError(f"engine loop of {self.key} failed: {self._loop.error!r}")
        return True

    async def update_members(self, members: list[Member]) -> None:
        """The coordinator's membership push: connect eagerly to the peers this role talks to."""
        other = {Role.PREFILL.value: {Role.DECODE.value}, Role.DECODE.value: {Role.PREFILL.value}}
        await self.peers.add_members(members, roles=other.get(self.role, set()))

    async def peer_lost(self, key: str, epoch: int) -> None:
        """A peer died: drop it and fail its in-flight transfers with PeerLost."""
        self.peers.lost(key, epoch)

    async def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = await self.loop.call(self.engine.stats)
        metrics.set_blocks(
            stats["num_free_blocks"], stats["num_leased_blocks"], worker=self.key, role=self.role
        )
        return {
            "key": self.key,
            "role": self.role,
            "epoch": self.epoch,
            "device": str(self.engine.device),
            **stats,
            **self.counters,
            "pending_reservations": len(self._reservations),
        }

    async def debug_inject_delay(self, delay_s: float) -> None:
        """Test hook: this worker's transfers report completion only ``delay_s`` after issue."""
        self.agent.inject_delay(delay_s)

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is not None:
            self._loop.stop()
        self.agent.close()

    def _release_lease(self, handle: KVHandle) -> None:
        async def release() -> None:
            try:
                peer = await self.peers.get(handle.engine_key, handle.epoch)
                peer.actor.release.remote(handle.transfer_id)
            except Exception as exc:  # P gone: its lease went with it
                log.info("could not release %s on %s: %r", handle.transfer_id, handle.engine_key, exc)

        task = asyncio.ensure_future(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- shared ---------------------------------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        """Cancel a request on this worker: free its blocks and lease at once, also if its prefill
        or reservation is still under way (it is then freed when it completes)."""
        self._mark_cancelled(request_id)
        self._reservations.pop(request_id, None)
        await self.loop.call(lambda: self.engine.abort(request_id))

    def _mark_cancelled(self, request_id: str) -> None:
        now = time.monotonic()
        self._cancelled[request_id] = now
        if len(self._cancelled) > 1024:  # forget old marks; a request id is used once
            horizon = now - self.config.runtime.remote_timeout_s
            self._cancelled = {k: t for k, t in self._cancelled.items() if t > horizon}

    def _check_not_cancelled(self, request_id: str) -> None:
        if self._cancelled.pop(request_id, None) is not None:
            raise RequestCancelled(f"request {request_id} was cancelled on {self.key}")

    def _finish(self, request_id: str) -> None:
        """Always called when a request's stream ends: idempotent abort frees anything left."""
        self.loop.unsubscribe(request_id)
        if request_id not in self._quarantined:
            self.loop.post(lambda: self.engine.abort(request_id))

    def quarantine(self, request_id: str, xfer: Transfer, max_wait_s: float) -> None:
        """Keep a request's blocks out of use until a transfer into them has ended, then free them."""
        self._quarantined.add(request_id)

        async def _free_later() -> None:
            try:
                await asyncio.to_thread(xfer.wait, max_wait_s)
            except Exception:
                pass  # failed or still running after max_wait_s: either way it is over for us
            self._quarantined.discard(request_id)
            self.loop.post(lambda: self.engine.abort(request_id))

        task = asyncio.ensure_future(_free_later())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def reserve_blocks(worker: WorkerBase, req: GenRequest, deadline_s: float) -> list[int]:
    """Reserve blocks for ``req``; wait for the engine to free some, up to ``deadline_s`` (monotonic)."""
    while True:
        blocks = await worker.loop.call_now(
            lambda: worker.engine.reserve(req.request_id, req.prompt_token_ids, req.params)
        )
        if blocks is not None:
            return list(blocks)
        if time.monotonic() >= deadline_s:
            raise DeadlineExceeded(
                f"{worker.key}: no free KV blocks for {req.request_id} before its deadline"
            )
        await worker.loop.next_step()


def _prepare_device(config: PipelineConfig, role: str) -> None:
    """CPU engines use the threads Ray gave them; cuda_ipc engines pick their GPU among all visible."""
    import torch

    if config.transfer.backend == "cuda_ipc":
        from moriio_ray.transfer.cuda_devices import select_device

        select_device()
    if config.engine.device == "cpu" or not torch.cuda.is_available():
        role_cfg = getattr(config.pool, role)
        torch.set_num_threads(max(1, int(role_cfg.num_cpus or 1)))
