"""READ mode on the decode worker: reserve, one batched read inside the lease, release, or recompute."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from moriio_ray import metrics
from moriio_ray.errors import DeadlineExceeded, MoriioRayError, TransferError, TransferTimeout
from moriio_ray.runtime.messages import GenRequest, KVHandle
from moriio_ray.runtime.peers import Peer
from moriio_ray.runtime.streaming import OutputQueue
from moriio_ray.runtime.worker_base import WorkerBase, reserve_blocks
from moriio_ray.transfer.handle import Transfer
from moriio_ray.transfer.plan import plan_blocks

log = logging.getLogger(__name__)


async def wait_transfer(xfer: Transfer, timeout_s: float) -> None:
    """Wait for a transfer without blocking the event loop (no thread hop if it is already done)."""
    if xfer.done():
        xfer.wait(0.0)
        return
    await asyncio.to_thread(xfer.wait, timeout_s)


@dataclass
class PullResult:
    first_token: int | None  # None: recomputed locally, the engine samples the first token itself
    first_logprob: float | None
    request_id: str  # the engine request id that now holds the prompt (new one after a recompute)
    queue: OutputQueue | None  # set when request_id changed: its subscription


class KVPuller:
    """Brings a prefilled prompt's KV from P into this decode worker's cache."""

    def __init__(
        self, worker: WorkerBase, req: GenRequest, handle: KVHandle, timings: dict[str, float]
    ) -> None:
        self.w = worker
        self.req = req
        self.handle = handle
        self.timings = timings
        self.cfg = worker.config.transfer
        self.peer: Peer | None = None
        self._released = False

    async def run(self) -> PullResult:
        h, w, rid = self.handle, self.w, self.req.request_id
        limit_unix = h.lease_deadline_unix - self.cfg.read_margin_s
        # Blocks: wait for them at most until the lease would end; later the read may not start.
        blocks = await reserve_blocks(w, self.req, time.monotonic() + max(0.0, limit_unix - time.time()))
        xfer: Transfer | None = None
        try:
            self.peer = await w.peers.get(h.engine_key, h.epoch)
            remote_mem = self.peer.info.kv_mem
            if remote_mem is None:
                raise TransferError(f"peer {h.engine_key!r} published no KV region")
            plan = plan_blocks(blocks, h.block_ids, w.layout, self.peer.info.layout)
            remaining_s = limit_unix - time.time()
            if remaining_s <= 0:
                raise TransferTimeout(
                    f"the lease of {h.transfer_id} on {h.engine_key} ends before the read could start"
                )
            t0 = time.perf_counter()
            xfer = w.agent.read(w.kv_mem, remote_mem, plan.local_offsets, plan.remote_offsets, plan.sizes)
            await wait_transfer(xfer, min(self.cfg.timeout_s, remaining_s))
            transfer_s = time.perf_counter() - t0
        except (MoriioRayError, TimeoutError) as exc:
            return await self._failed(exc, xfer)
        w.counters["transfers"] += 1
        w.counters["transfer_bytes"] += plan.num_bytes
        metrics.record_transfer(
            plan.num_bytes, transfer_s, plan.num_segments, backend=w.agent.name, role=w.role
        )
        self.timings["transfer_s"] = transfer_s
        self.timings["transfer_bytes"] = float(plan.num_bytes)
        self.timings["transfer_segments"] = float(plan.num_segments)
        return PullResult(h.first_token, h.first_logprob, rid, None)

    def release(self) -> None:
        """Tell P to free the lease now (fire and forget: P frees it at lease + grace anyway)."""
        if self.peer is not None and not self._released:
            self._released = True
            self.peer.actor.release.remote(self.handle.transfer_id)

    async def _failed(self, exc: BaseException, xfer: Transfer | None) -> PullResult:
        w, rid = self.w, self.req.request_id
        kind = type(exc).__name__
        log.warning("%s: KV read for %s failed (%s): %s", w.key, rid, kind, exc)
        w.counters["transfer_failures"] += 1
        metrics.record_failure(kind, role=w.role)
        self.release()
        if self.cfg.on_transfer_failure == "fail":
            raise exc
        new_rid = rid
        if xfer is not None and not xfer.done():
            # The read may still land in these blocks: keep them out of use until it ends.
            new_rid = f"{rid}:recompute"
            w.quarantine(rid, xfer, self.cfg.timeout_s + self.cfg.lease_grace_s)
            await self._reserve_fresh(new_rid)
        q = w.loop.subscribe(new_rid)  # before the call, so that no output can be missed
        await w.loop.call(lambda: w.engine.prefill_into_reserved(new_rid))
        w.counters["recomputes"] += 1
        self.timings["recomputed"] = 1.0
        return PullResult(None, None, new_rid, q)

    async def _reserve_fresh(self, new_rid: str) -> None:
        fresh = GenRequest(
            request_id=new_rid, prompt_token_ids=self.req.prompt_token_ids, params=self.req.params
        )
        try:
            await reserve_blocks(self.w, fresh, time.monotonic() + self.w.config.runtime.remote_timeout_s)
        except DeadlineExceeded:
            raise TransferError(f"{self.w.key}: no blocks to recompute {self.req.request_id}") from None
