"""P's part of a worker: prefill and lease (READ), reserve on D and prefill while pushing each layer
(WRITE), and the hand-over to D.

READ: P hands its lease to D through ``D.deliver``, sent outside the request's task lineage and
batched with the other hand-overs to that D of the same loop turn (``worker/handovers.py``); the
call returns once D's reads have ended (or will never start), and P frees the leases then. P is
the lease's one owner: a cancel that reaches P while D holds the handle leaves the lease alone (D's
read may still be reading it); D's death fails the call, which frees it too; the expiry sweep at the
lease's deadline plus grace is the backstop.
WRITE: P reserves D's blocks itself (``D.reserve``), then pushes each computed layer into them. A
push that ends early (cancelled, failed, timed out) starts no more writes; once those started have
ended, P frees its blocks and tells D (``pushes_ended``), whose reserved blocks stay out of use
until then; the result goes to D batched like READ's hand-overs. Under tensor parallelism every rank
pushes its own KV heads: rank 0 here, the others on
``RankGroup.prepare_push`` before the prefill starts; the push is over when every rank's is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from moriio_ray import metrics
from moriio_ray.engine.batch import PrefillChunk
from moriio_ray.engine.outputs import PrefillResult
from moriio_ray.errors import DeadlineExceeded
from moriio_ray.protocol import wire
from moriio_ray.protocol.deadline import deadline
from moriio_ray.protocol.detached import send
from moriio_ray.protocol.messages import GenRequest, KVHandle, PeerRef, PushResult, Reservation
from moriio_ray.worker.core import WorkerCore
from moriio_ray.worker.handovers import Handovers, refusal
from moriio_ray.worker.peers import Peer
from moriio_ray.worker.push import LayerPusher, push_targets
from moriio_ray.worker.requests import WorkerRequest

log = logging.getLogger(__name__)


class PrefillSide:
    """Runs prompts and hands their result to D (``deliver``) and back to the caller."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core
        self._handed: set[str] = set()  # READ: leases D may be reading (its ``deliver`` runs)
        self._settling: set[str] = set()  # WRITE: requests whose early-ended pushes P still waits for
        self.handovers = Handovers(lambda coro: core.spawn(coro, detach=True))
        if core.config.mode == "write":  # READ pays no per-layer call
            core.engine.set_layer_hook(self._on_layer)

    async def prefill(self, req: GenRequest, to: PeerRef | None = None, caller: str = "") -> KVHandle:
        """READ: prefill, sample the first token and lease the prompt's blocks; hand them to ``to``
        (D), whose tokens go to ``caller``'s stream. (Without ``to`` the lease lasts until it expires.)"""
        c = self.core
        rec = c.table.open(req.request_id)
        ok = False
        try:
            peer = await c.peers.get(to.key, to.epoch) if to is not None else None
            pre, reason, prefill_s = await self._prefill(rec, req)
            handle = KVHandle(
                **_first(pre, reason, prefill_s, time.time()),
                transfer_id=req.request_id,
                engine_key=c.key,
                epoch=c.epoch,
                block_ids=pre.block_ids,
                num_tokens=pre.num_tokens,
                lease_deadline_unix=pre.lease_deadline_unix,
            )
            if peer is not None and reason is None:  # (a first token that ends it leases nothing)
                self._handed.add(handle.transfer_id)
                self._hand_over(peer, req, handle, caller)
            ok = True
            return handle
        finally:
            c.table.close(rec)
            if not ok:  # cancelled or failed: free the blocks (and any lease) at once
                c.loop.post(lambda: c.engine.abort(req.request_id))

    def _hand_over(self, peer: Peer, req: GenRequest, handle: KVHandle, caller: str) -> None:
        """Queue the hand-over now, before the caller's reply goes, so that it leaves in this loop
        turn's batch. D reads the lease inside its ``deliver`` call; its end (or failure: D died,
        or refused the request) frees the lease. P is the one owner of that release; its expiry
        sweep is the backstop should D hang."""
        c = self.core
        tid = handle.transfer_id
        wait_s = max(0.0, handle.lease_deadline_unix - time.time()) + c.config.transfer.lease_grace_s
        item = (wire.pack(req), wire.pack(handle), caller)

        def ended(outcome: asyncio.Future[str | None]) -> None:
            self._handed.discard(tid)
            if not outcome.cancelled() and isinstance(outcome.exception(), DeadlineExceeded):
                return  # the sweep frees the lease at its deadline plus grace
            why = refusal(outcome)
            if why is not None:
                log.info("the hand-over of %s to %s ended with %s", tid, peer.key, why)
            c.loop.post(lambda: c.engine.release(tid))

        self.handovers.hand_over(peer, item, wait_s).add_done_callback(ended)

    async def prefill_push(self, req: GenRequest, to: PeerRef, caller: str = "") -> PushResult:
        """WRITE: reserve blocks on D (``to``), prefill while pushing each computed layer into them,
        free ours and hand the result to D, whose tokens go to ``caller``'s stream."""
        c = self.core
        rec = c.table.open(req.request_id)
        pusher: LayerPusher | None = None
        ok = False
        try:
            peer = await c.peers.get(to.key, to.epoch)
            reserved = await deadline(
                peer.actor.reserve.remote(wire.pack(req), caller),
                c.config.runtime.remote_timeout_s,
                f"the reservation on {to.key}",
            )
            reservation: Reservation = wire.unpack(reserved, Reservation)
            assert c.engine.kv_mem is not None
            d_ranks = peer.info.rank_descs()
            targets = push_targets(c.engine.layout, d_ranks)
            last_push_unix = reservation.deadline_unix - c.config.transfer.read_margin_s
            held = reservation.num_cached_blocks  # D holds these: P pushes only the rest
            dest = reservation.block_ids
            rec.pusher = pusher = LayerPusher(
                c.agent, c.engine.kv_mem, c.engine.layout, targets, dest, last_push_unix, held
            )
            if c.group is not None:
                await c.group.prepare_push(
                    req.request_id, d_ranks, reservation.block_ids, last_push_unix, held
                )
            pre, reason, prefill_s = await self._prefill(rec, req)
            done_unix = time.time()
            t0 = time.perf_counter()
            limit_s = max(0.0, min(c.config.transfer.timeout_s, reservation.deadline_unix - done_unix))
            num_bytes, num_segments = await self._wait_pushes(req.request_id, pusher, limit_s)
            if num_bytes:  # nothing moves when D held the whole prompt
                c.counters["transfers"] += 1
                c.counters["transfer_bytes"] += num_bytes
                metrics.record_transfer(
                    num_bytes, prefill_s, num_segments, backend=c.agent.name, role=c.role.value
                )
            result = PushResult(
                **_first(pre, reason, prefill_s, done_unix),
                request_id=req.request_id,
                push_wait_s=time.perf_counter() - t0,
                num_bytes=num_bytes,
                num_segments=num_segments,
            )
            ok = True  # every push has landed: the result tells D so (and ends its reservation)
            item = (wire.pack(req), wire.pack(result), caller)
            wait_s = c.config.runtime.remote_timeout_s
            outcome = self.handovers.hand_over(peer, item, wait_s)
            outcome.add_done_callback(_log_refusal(req.request_id, to.key))
            return result
        finally:
            c.table.close(rec)
            if ok:  # P keeps nothing once the push is over: D holds the KV now
                c.loop.post(lambda: c.engine.abort(req.request_id))
            else:  # cancelled or failed: settle the pushes first (off this task: it may be cancelled)
                self._settling.add(req.request_id)
                c.spawn(self._settle(req.request_id, pusher, to), detach=True)

    async def _settle(self, request_id: str, pusher: LayerPusher | None, d: PeerRef) -> None:
        """A push that ended early: start no more writes, wait for those started (bounded), free
        P's blocks, and tell D that nothing more will land in its reservation."""
        c = self.core
        timeout_s = c.config.transfer.timeout_s
        settled = True
        try:
            if pusher is not None:
                settled = await asyncio.to_thread(pusher.settle, timeout_s)
            if c.group is not None:
                settled = await c.group.settle_push(request_id, timeout_s) and settled
        finally:
            c.loop.post(lambda: c.engine.abort(request_id))
            self._settling.discard(request_id)
        if settled:
            await self._pushes_ended(d, request_id)
        else:  # D frees the reservation at its deadline plus grace instead
            log.warning(
                "pushes of %s still ran after %s s; D keeps its blocks to their deadline",
                request_id,
                timeout_s,
            )

    async def _pushes_ended(self, d: PeerRef, request_id: str) -> None:
        try:
            peer = await self.core.peers.get(d.key, d.epoch)
        except Exception as exc:  # D gone: so is its reservation
            log.info("could not tell %s that the pushes of %s ended: %r", d.key, request_id, exc)
            return
        send(peer.actor.pushes_ended, request_id)

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

    async def release(self, transfer_id: str) -> bool:
        """Free a lease now (tests: a lease handed to nobody)."""
        released: bool = await self.core.loop.call_now(lambda: self.core.engine.release(transfer_id))
        return released

    async def abort(self, request_id: str, push_to: PeerRef | None = None) -> None:
        """Cancel a request here. A lease handed to D stays until D's ``deliver`` returns (its read
        may still run). WRITE (``push_to``: the D it pushes to): if no push of it is running here,
        none will start (the cancel mark refuses it), and D hears so at once."""
        c = self.core
        # a push running or settling here tells D itself once it has ended
        running = c.table.get(request_id) is not None or request_id in self._settling
        if not running and request_id in self._handed:
            return
        await c.abort(request_id)
        if push_to is not None and not running:
            await self._pushes_ended(push_to, request_id)

    async def _prefill(self, rec: WorkerRequest, req: GenRequest) -> tuple[PrefillResult, str | None, float]:
        """(the prefill's result, the finish reason if the first token ended it, seconds)."""
        c = self.core
        c.counters["requests"] += 1
        rec.task = asyncio.current_task()
        # kept here: the output clears rec.prefill_out, maybe before add_request's call returns
        rec.prefill_out = first = asyncio.get_running_loop().create_future()
        t0 = time.perf_counter()
        await c.loop.call_now(
            lambda: c.engine.add_request(
                req.request_id, req.prompt_token_ids, req.params, sample_offset=req.sample_offset
            )
        )
        out = await deadline(first, c.config.runtime.remote_timeout_s, f"the prefill of {req.request_id}")
        rec.check_cancelled()
        assert out.prefill is not None, "a prefill engine's output carries its PrefillResult"
        return out.prefill, out.finish_reason, time.perf_counter() - t0

    def _on_layer(self, layer: int, chunks: list[PrefillChunk]) -> None:
        # engine thread: push this layer of what each chunk completed, where it has a destination
        for chunk in chunks:
            rec = self.core.table.by_engine(chunk.request_id)
            if rec is not None and rec.pusher is not None:
                rec.pusher.on_layer(layer, chunk, self.core.engine.prefill_blocks(chunk.request_id))


def _log_refusal(request_id: str, d_key: str) -> Callable[[asyncio.Future[str | None]], None]:
    """WRITE: nobody waits for D's answer to a push's result; a refusal or failure is logged."""

    def done(outcome: asyncio.Future[str | None]) -> None:
        why = refusal(outcome)
        if why is not None:
            log.info("the result of %s's pushes reached %s with %s", request_id, d_key, why)

    return done


def _first(pre: PrefillResult, reason: str | None, prefill_s: float, done_unix: float) -> dict[str, Any]:
    """The fields of P's reply that tell the first token (``Prefilled``), in either mode."""
    return {
        "first_token": pre.first_token,
        "first_logprob": pre.first_logprob,
        "first_top_logprobs": pre.first_top_logprobs,
        "prompt_logprobs": pre.prompt_logprobs,
        "finish_reason": reason,
        "num_cached_tokens": pre.num_cached_tokens,
        "prefill_done_unix": done_unix,
        "prefill_s": prefill_s,
    }
