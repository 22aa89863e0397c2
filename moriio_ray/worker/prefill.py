"""P's part of a worker: prefill and lease (READ), prefill while pushing each layer (WRITE), release.

Under tensor parallelism every rank pushes its own KV heads (WRITE): rank 0 here, the others on
``RankGroup.prepare_push`` before the prefill starts; the push is over when every rank's is.
"""

from __future__ import annotations

import asyncio
import time

from moriio_ray import metrics
from moriio_ray.engine.outputs import PrefillResult
from moriio_ray.runtime.deadline import deadline
from moriio_ray.runtime.detached import send
from moriio_ray.runtime.messages import GenRequest, Handoff, KVHandle, PeerRef, PushResult, Reservation
from moriio_ray.worker.core import WorkerCore
from moriio_ray.worker.push import LayerPusher, push_targets
from moriio_ray.worker.requests import WorkerRequest


class PrefillSide:
    """Runs prompts and hands their result to D (``deliver_to``) and back to the caller."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core
        core.engine.set_layer_hook(self._on_layer)

    async def prefill(self, req: GenRequest, deliver_to: PeerRef | None = None) -> KVHandle:
        """READ: prefill, sample the first token and lease the prompt's blocks for D to read."""
        c = self.core
        rec = c.table.open(req.request_id)
        ok = False
        try:
            pre, reason, prefill_s = await self._prefill(rec, req)
            handle = KVHandle(
                transfer_id=req.request_id,
                engine_key=c.key,
                epoch=c.epoch,
                block_ids=pre.block_ids,
                num_tokens=pre.num_tokens,
                first_token=pre.first_token,
                first_logprob=pre.first_logprob,
                lease_deadline_unix=pre.lease_deadline_unix,
                prefill_done_unix=time.time(),
                prefill_s=prefill_s,
                finish_reason=reason,
            )
            await self._deliver(deliver_to, req.request_id, handle)
            ok = True
            return handle
        finally:
            c.table.close(rec)
            if not ok:  # cancelled or failed: free the blocks (and any lease) at once
                c.loop.post(lambda: c.engine.abort(req.request_id))

    async def prefill_push(
        self, req: GenRequest, reservation: Reservation, deliver_to: PeerRef | None = None
    ) -> PushResult:
        """WRITE: prefill while pushing each computed layer into D's reserved blocks; then free ours."""
        c = self.core
        rec = c.table.open(req.request_id)
        try:
            peer = await c.peers.get(reservation.engine_key, reservation.epoch)
            assert c.engine.kv_mem is not None
            d_ranks = peer.info.rank_descs()
            targets = push_targets(c.engine.layout, d_ranks)
            rec.pusher = pusher = LayerPusher(
                c.agent, c.engine.kv_mem, c.engine.layout, targets, reservation.block_ids
            )
            if c.group is not None:
                await c.group.prepare_push(req.request_id, d_ranks, reservation.block_ids)
            pre, reason, prefill_s = await self._prefill(rec, req)
            done_unix = time.time()
            t0 = time.perf_counter()
            limit_s = max(0.0, min(c.config.transfer.timeout_s, reservation.deadline_unix - done_unix))
            num_bytes, num_segments = await self._wait_pushes(req.request_id, pusher, limit_s)
            c.counters["transfers"] += 1
            c.counters["transfer_bytes"] += num_bytes
            metrics.record_transfer(
                num_bytes, prefill_s, num_segments, backend=c.agent.name, role=c.role.value
            )
            result = PushResult(
                request_id=req.request_id,
                first_token=pre.first_token,
                first_logprob=pre.first_logprob,
                prefill_done_unix=done_unix,
                prefill_s=prefill_s,
                push_wait_s=time.perf_counter() - t0,
                num_bytes=num_bytes,
                num_segments=num_segments,
                finish_reason=reason,
            )
            await self._deliver(deliver_to, req.request_id, result)
            return result
        finally:
            c.table.close(rec)
            # P keeps nothing once the push is over (or failed): D holds the KV now.
            c.loop.post(lambda: c.engine.abort(req.request_id))
            if c.group is not None:
                c.group.drop_push(req.request_id)  # a no-op where the push was waited for

    async def _wait_pushes(self, request_id: str, pusher: LayerPusher, limit_s: float) -> tuple[int, int]:
        """Wait for this rank's pushes and (tensor parallelism) the other ranks'; (bytes, segments)."""
        c = self.core
        try:
            await asyncio.to_thread(pusher.wait_all, limit_s)
            num_bytes, num_segments = pusher.num_bytes, pusher.num_segments
            if c.group is not None:
                more_bytes, more_segments = await c.group.wait_push(request_id, limit_s)
                num_bytes, num_segments = num_bytes + more_bytes, num_segments + more_segments
        except Exception as exc:
            c.counters["transfer_failures"] += 1
            metrics.record_failure(type(exc).__name__, role=c.role.value)
            raise
        return num_bytes, num_segments

    async def _deliver(self, to: PeerRef | None, request_id: str, result: Handoff) -> None:
        """Hand the result straight to D (one Ray call; the caller gets its own copy)."""
        if to is not None:
            peer = await self.core.peers.get(to.key, to.epoch)
            send(peer.actor.deliver, request_id, result)  # D releases what it cannot use

    async def release(self, transfer_id: str) -> bool:
        """D has read (or given up on) a lease: free P's blocks now."""
        released: bool = await self.core.loop.call_now(lambda: self.core.engine.release(transfer_id))
        return released

    async def _prefill(self, rec: WorkerRequest, req: GenRequest) -> tuple[PrefillResult, str | None, float]:
        """(the prefill's result, the finish reason if the first token ended it, seconds)."""
        c = self.core
        c.counters["requests"] += 1
        rec.task = asyncio.current_task()
        # kept here: the output clears rec.prefill_out, maybe before add_request's call returns
        rec.prefill_out = first = asyncio.get_running_loop().create_future()
        t0 = time.perf_counter()
        await c.loop.call_now(lambda: c.engine.add_request(req.request_id, req.prompt_token_ids, req.params))
        out = await deadline(first, c.config.runtime.remote_timeout_s, f"the prefill of {req.request_id}")
        rec.check_cancelled()
        assert out.prefill is not None, "a prefill engine's output carries its PrefillResult"
        return out.prefill, out.finish_reason, time.perf_counter() - t0

    def _on_layer(self, layer: int, request_ids: list[str]) -> None:
        # engine thread: push this layer for every request of the batch that has a destination
        for rid in request_ids:
            rec = self.core.table.by_engine(rid)
            if rec is not None and rec.pusher is not None:
                rec.pusher.on_layer(layer, self.core.engine.prefill_blocks(rid))
