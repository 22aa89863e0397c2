"""A tensor-parallel rank other than 0: a plain class (tests drive it without Ray) and its Ray actor.

It holds its model shard and KV shard (``RankEngine``) and its own transfer agent. Its engine
thread runs every batch rank 0 broadcasts; its asyncio side serves rank 0's calls: ``read`` (its
share of a READ-mode pull), ``prepare_push`` / ``wait_push`` (its share of a WRITE-mode push),
``peer_lost`` (fail in-flight transfers with a dead peer's ranks), health and stats. It never talks
to callers or schedules anything; if its group breaks it reports unhealthy, and the coordinator
replaces the whole engine.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from moriio_ray import env
from moriio_ray.config import PipelineConfig
from moriio_ray.engine.batch import PrefillChunk
from moriio_ray.errors import InvalidRequest, MoriioRayError
from moriio_ray.protocol.messages import RankDesc, Role
from moriio_ray.transfer import create_agent
from moriio_ray.transfer.plan import PullItem

if TYPE_CHECKING:  # these load torch: imported where used, in the rank's own process, so that
    from moriio_ray.worker.push import LayerPusher, PushOrder  # building the actor class (the
    # coordinator does) loads none of it

log = logging.getLogger(__name__)

JOIN_TIMEOUT = timedelta(seconds=300)


def rank_key(key: str, rank: int) -> str:
    """The agent key of rank ``rank`` of engine ``key`` (rank 0's is the engine's own)."""
    return key if rank == 0 else f"{key}.rank{rank}"


class RankWorker:
    """Rank ``rank`` (> 0) of engine ``key``; ``join`` builds it once rank 0 hosts the group's store."""

    def __init__(
        self,
        config: PipelineConfig,
        role: str,
        key: str,
        rank: int,
        size: int,
        *,
        epoch: int = 1,
        token: bytes | None = None,
    ) -> None:
        from moriio_ray.engine.device import resolve_device
        from moriio_ray.worker.core import _prepare_device

        logging.getLogger("moriio_ray").setLevel(env.log_level())
        self.config = config
        self.role = Role(role)
        self.key = key
        self.rank = rank
        self.size = size
        self.epoch = epoch
        _prepare_device(config, self.role)
        self.device = resolve_device(config.engine.device)  # here: the current device is per thread
        self.agent = create_agent(config.transfer, rank_key(key, rank), epoch=epoch, token=token)
        self.engine: Any = None  # RankEngine, once joined
        self.pushers: dict[str, LayerPusher] = {}
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    async def join(self, host: str, port: int) -> RankDesc:
        """Join rank 0's process group, build this rank, start following; its descriptors."""
        await asyncio.to_thread(self._build, host, port)
        engine = self.engine
        self._thread = threading.Thread(target=self._follow, name=f"tp-rank-{self.rank}", daemon=True)
        self._thread.start()
        assert engine.kv_mem is not None
        return RankDesc(
            rank=self.rank, engine_desc=self.agent.engine_desc(), kv_mem=engine.kv_mem, layout=engine.layout
        )

    def _build(self, host: str, port: int) -> None:
        import torch
        import torch.distributed as dist

        from moriio_ray.engine.rank import RankEngine
        from moriio_ray.engine.tp import init_group

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # this thread builds the rank on its own GPU
        store = dist.TCPStore(host, port, is_master=False, timeout=JOIN_TIMEOUT)
        from moriio_ray.worker.ranks import end_process

        tp = init_group(self.rank, self.size, store, self.device, on_broken=end_process)
        self.engine = RankEngine(
            self.config.model,
            self.config.engine,
            role=self.role.value,
            tp=tp,
            agent=self.agent,
            cuda_graphs=self.config.engine.cuda_graphs,
        )
        self.engine.set_layer_hook(self._on_layer)

    def _follow(self) -> None:
        engine = self.engine
        if engine.parts.device.type == "cuda":
            import torch

            torch.cuda.set_device(engine.parts.device)  # the current device is per thread
        try:
            engine.follow()
            self.error = MoriioRayError(f"rank {self.rank} of {self.key}: rank 0 closed the engine")
        except BaseException as exc:  # the group broke: a peer rank died
            log.error("rank %d of %s: the engine group failed: %r", self.rank, self.key, exc)
            self.error = exc

    async def check_health(self) -> bool:
        if self.error is not None:
            raise RuntimeError(f"rank {self.rank} of {self.key} failed: {self.error!r}")
        return True

    async def stats(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "key": rank_key(self.key, self.rank),
            "rank": self.rank,
            "num_steps": engine.num_steps if engine is not None else 0,
            "pushers": len(self.pushers),
        }

    async def until_death(self) -> None:
        """Never returns: the coordinator's call fails when this actor dies (its death watch)."""
        await asyncio.Event().wait()

    async def shutdown(self) -> None:
        self.agent.close()

    # -- transfers ------------------------------------------------------------------------------

    async def read(self, items: list[PullItem], timeout_s: float) -> int:
        """READ: this rank's reads of one request (one per P rank holding its heads); bytes moved.

        Waits until they have ended (at most ``timeout_s``): rank 0 quarantines the blocks
        behind this call when it gives up earlier."""
        from moriio_ray.worker.tp_transfer import issue_reads, wait_all

        xfers = issue_reads(self.agent, self.engine.kv_mem, items)
        await asyncio.to_thread(wait_all, xfers, timeout_s)
        return sum(x.num_bytes for x in xfers)

    async def prepare_push(self, order: PushOrder) -> None:
        """WRITE: push this rank's heads of ``order.request_id``'s prefill, layer by layer, into D's
        ranks (none after ``order.last_push_unix``; none of the blocks before ``order.first_block``,
        which D holds)."""
        from moriio_ray.worker.push import LayerPusher, push_targets

        engine = self.engine
        targets = push_targets(engine.layout, order.peer_ranks)
        for target in targets:
            await asyncio.to_thread(self.agent.connect, target.engine_desc)
        self.pushers[order.request_id] = LayerPusher(
            self.agent,
            engine.kv_mem,
            engine.layout,
            targets,
            order.dest_blocks,
            order.last_push_unix,
            order.first_block,
        )

    async def wait_push(self, request_id: str, timeout_s: float) -> tuple[int, int]:
        """WRITE: wait for the push of every layer; (bytes, segments)."""
        pusher = self.pushers.get(request_id)
        if pusher is None:
            raise InvalidRequest(f"request_id: {request_id!r} has no push on rank {self.rank} of {self.key}")
        await asyncio.to_thread(pusher.wait_all, timeout_s)  # failed: kept for settle_push
        self.pushers.pop(request_id, None)
        return pusher.num_bytes, pusher.num_segments

    async def settle_push(self, request_id: str, timeout_s: float) -> bool:
        """WRITE, the request ended early: start no more pushes and wait (at most ``timeout_s``)
        until those started have ended. True when none can land any more."""
        pusher = self.pushers.pop(request_id, None)
        return True if pusher is None else await asyncio.to_thread(pusher.settle, timeout_s)

    def _on_layer(self, layer: int, chunks: list[PrefillChunk]) -> None:
        # engine thread: push this layer of what each chunk completed, where it has a destination
        for chunk in chunks:
            pusher = self.pushers.get(chunk.request_id)
            if pusher is not None:
                pusher.on_layer(layer, chunk, self.engine.prefill_blocks(chunk.request_id))

    async def peer_lost(self, keys: list[str]) -> None:
        """A peer engine died: drop its ranks; their in-flight transfers fail with PeerLost."""
        for key in keys:
            self.agent.disconnect(key)


def make_rank_actor_class() -> Any:
    """The Ray actor of RankWorker (built lazily so that importing this module needs no Ray)."""
    import ray

    return ray.remote(RankWorker)
