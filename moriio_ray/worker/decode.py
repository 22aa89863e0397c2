"""D's part of a worker: wait for P's hand-over, bring the prompt's KV in, join the decode batch.

READ: reserve blocks, plan one coalesced batch of segments, issue one read inside P's lease
(never past ``lease deadline - read_margin_s``), start decoding, release P's lease. With prefix
caching the reservation starts with the blocks D holds already (its own cached prefix): the read
covers only the rest, the tail, and a prompt D holds whole needs no read at all (P's lease is
released at once). D's blocks and P's are the prompt's blocks on both sides, so their counts agree.
A read that fails or runs late recomputes the prompt here (``on_transfer_failure: recompute``) or ends the
request with its typed error (``fail``); blocks that a read still in flight may write are
quarantined until it has ended, also when the request is cancelled mid-read, and P's lease is
released only then (the read may still be reading P's blocks).
WRITE: the blocks were reserved (``reserve``) and P pushed every layer; decoding starts at once. A
request that ends before P's result came keeps its reservation quarantined until P says its pushes
have ended (``WorkerCore.pushes_ended``), or until the reservation's deadline plus grace.
Tensor parallelism: each rank of this engine reads, from every P rank holding some of its KV heads,
one batched read (``tp_transfer``); the one read is then all of them, under the same deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from moriio_ray import metrics
from moriio_ray.errors import DeadlineExceeded, MoriioRayError, TransferError, TransferTimeout
from moriio_ray.runtime.detached import send
from moriio_ray.runtime.messages import (
    DecodeStart,
    GenRequest,
    Handoff,
    KVHandle,
    PushResult,
    RankDesc,
    Reservation,
)
from moriio_ray.transfer.handle import Transfer
from moriio_ray.worker.core import WorkerCore
from moriio_ray.worker.requests import WorkerRequest
from moriio_ray.worker.tp_transfer import plan_pulls, start_pull

log = logging.getLogger(__name__)


class DecodeSide:
    """Takes requests whose prompt another engine ran; their tokens go to the caller's stream."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core
        self._own_ranks: list[RankDesc] | None = None

    async def _ranks(self) -> list[RankDesc]:
        """This engine's ranks (rank 0 alone at TP = 1), as P's ranks are matched against them."""
        if self._own_ranks is None:
            c = self.core
            assert c.engine.kv_mem is not None
            own = RankDesc(
                rank=0, engine_desc=c.agent.engine_desc(), kv_mem=c.engine.kv_mem, layout=c.engine.layout
            )
            self._own_ranks = [own, *(await c.group.descs() if c.group is not None else [])]
        return self._own_ranks

    async def reserve(self, req: GenRequest) -> Reservation:
        """WRITE: reserve blocks for a prompt that P will push into."""
        c = self.core
        rec = c.table.open(req.request_id)
        rec.task = asyncio.current_task()
        try:
            deadline_s = time.monotonic() + c.config.runtime.remote_timeout_s
            blocks, held = await c.reserve_blocks(req, rec.engine_id, deadline_s)
            rec.check_cancelled()
        except BaseException:
            c.discard(rec)
            raise
        finally:
            rec.task = None
        rec.reservation = Reservation(
            request_id=req.request_id,
            engine_key=c.key,
            epoch=c.epoch,
            block_ids=blocks,
            deadline_unix=time.time() + c.config.transfer.kv_lease_s,
            num_cached_blocks=held,
        )
        grace_s = c.config.transfer.kv_lease_s + c.config.transfer.lease_grace_s
        asyncio.get_running_loop().call_later(grace_s, self._expire, rec)
        return rec.reservation

    def _expire(self, rec: WorkerRequest) -> None:
        # nobody came to decode into the reservation (its caller died between the calls)
        if rec.caller is None and self.core.table.get(rec.request_id) is rec:
            log.warning("reservation %s expired unused; freeing its blocks", rec.request_id)
            self.core.discard(rec)

    async def deliver(self, request_id: str, source: Handoff) -> None:
        """P hands over its prefill result for a decode that waits here (or will)."""
        if isinstance(source, PushResult):  # every push has landed, whoever takes the result
            self.core.pushes_ended(request_id)
        if not self.core.mailbox.deliver(request_id, source) and isinstance(source, KVHandle):
            self.core.release_lease(source)  # a duplicate (retried prefill) or an abandoned request

    async def decode(self, req: GenRequest, caller: str) -> DecodeStart:
        """Wait for P's hand-over, bring the KV in and join the batch; the tokens after the first
        (the caller has that one from P) go to ``caller``'s output stream."""
        c = self.core
        rid = req.request_id
        rec = c.table.get(rid)
        if rec is None:  # READ (WRITE: ``reserve`` opened it)
            rec = c.table.open(rid)
        rec.caller = caller
        rec.task = asyncio.current_task()
        c.counters["requests"] += 1
        started = False
        try:
            rec.check_cancelled()
            source, handoff_unix = await c.mailbox.take(rid, c.config.runtime.remote_timeout_s)
            if source.finish_reason is not None:  # the first token already ended the request
                return DecodeStart(handoff_unix=handoff_unix, decode_start_unix=time.time())
            if isinstance(source, KVHandle):
                start = await self._pull(rec, req, source, handoff_unix)
            else:
                start = await self._accept_push(rec, source, handoff_unix)
            started = True
            return start
        finally:
            rec.task = None
            if not started:
                late = c.mailbox.abandon(rid)
                if isinstance(late, KVHandle):  # handed over, never read here: free P's lease
                    c.release_lease(late)
                c.discard(rec)

    async def _accept_push(self, rec: WorkerRequest, push: PushResult, handoff_unix: float) -> DecodeStart:
        if rec.reservation is None:
            raise TransferError(f"request {rec.request_id!r}: no reservation on {self.core.key} (expired?)")
        rec.reservation = None
        await self._start(rec, push.first_token)
        return DecodeStart(handoff_unix=handoff_unix, decode_start_unix=time.time())

    async def _pull(
        self, rec: WorkerRequest, req: GenRequest, h: KVHandle, handoff_unix: float
    ) -> DecodeStart:
        c = self.core
        cfg = c.config.transfer
        limit_unix = h.lease_deadline_unix - cfg.read_margin_s
        xfer: Transfer | None = None
        try:
            # blocks: wait for them at most until the lease would end; later the read may not start
            until_s = time.monotonic() + max(0.0, limit_unix - time.time())
            blocks, held = await c.reserve_blocks(req, rec.engine_id, until_s)
            if len(blocks) != len(h.block_ids):
                raise TransferError(
                    f"{c.key} reserved {len(blocks)} blocks for {h.transfer_id}, P leased {len(h.block_ids)}"
                )
            peer = await c.peers.get(h.engine_key, h.epoch)
            t0 = time.perf_counter()
            if held < len(blocks):  # read only the tail that D's cache lacks
                assert c.engine.kv_mem is not None
                tail = (blocks[held:], h.block_ids[held:])
                pulls = plan_pulls(await self._ranks(), peer.info.rank_descs(), *tail)
                remaining_s = limit_unix - time.time()
                if remaining_s <= 0:
                    raise TransferTimeout(
                        f"the lease of {h.transfer_id} on {h.engine_key} ends before the read"
                    )
                timeout_s = cfg.timeout_s + cfg.lease_grace_s
                xfer = start_pull(c.agent, c.engine.kv_mem, pulls, c.group, timeout_s)
                await _wait(xfer, min(cfg.timeout_s, remaining_s))
            transfer_s = time.perf_counter() - t0
        except asyncio.CancelledError:
            # a read still running may still read P's blocks: P's lease goes once it has ended
            if not self._quarantine_if_running(rec, xfer, then=lambda: c.release_lease(h)):
                c.release_lease(h)
            raise
        except (MoriioRayError, TimeoutError) as exc:
            return await self._recompute(rec, req, h, exc, xfer, handoff_unix)
        try:
            await self._start(rec, h.first_token)
            started_unix = time.time()  # the engine decodes it from here (the release is not in it)
        finally:  # the read has ended: P's lease goes, whatever happens to the start (a cancel)
            send(peer.actor.release, h.transfer_id)  # after the hand-over: off the critical path
        if xfer is None:  # D held the whole prompt: nothing moved
            return DecodeStart(handoff_unix=handoff_unix, decode_start_unix=started_unix)
        start = DecodeStart(
            handoff_unix=handoff_unix,
            decode_start_unix=started_unix,
            transfer_s=transfer_s,
            transfer_bytes=xfer.num_bytes,
            transfer_segments=xfer.num_segments,
        )
        c.counters["transfers"] += 1
        c.counters["transfer_bytes"] += xfer.num_bytes
        metrics.record_transfer(
            xfer.num_bytes, transfer_s, xfer.num_segments, backend=c.agent.name, role="decode"
        )
        return start

    async def _recompute(
        self,
        rec: WorkerRequest,
        req: GenRequest,
        h: KVHandle,
        exc: BaseException,
        xfer: Transfer | None,
        handoff_unix: float,
    ) -> DecodeStart:
        c = self.core
        kind = type(exc).__name__
        log.warning("%s: KV read for %s failed (%s): %s", c.key, rec.request_id, kind, exc)
        c.counters["transfer_failures"] += 1
        metrics.record_failure(kind, role="decode")
        # a read still running (it timed out) keeps its blocks here, and P's lease, until it ends
        held = self._quarantine_if_running(rec, xfer, then=lambda: c.release_lease(h))
        if not held:
            c.release_lease(h)
        if c.config.transfer.on_transfer_failure == "fail" or isinstance(exc, DeadlineExceeded):
            raise exc  # fail, or no blocks came for the request at all
        if held:
            deadline_s = time.monotonic() + c.config.runtime.remote_timeout_s
            try:
                await c.reserve_blocks(req, rec.engine_id, deadline_s)
            except DeadlineExceeded:
                raise TransferError(f"{c.key}: no blocks to recompute {rec.request_id}") from None
        await c.loop.call(lambda: c.engine.recompute_reserved(rec.engine_id, h.first_token))
        c.counters["recomputes"] += 1
        return DecodeStart(handoff_unix=handoff_unix, decode_start_unix=time.time(), recomputed=True)

    def _quarantine_if_running(
        self, rec: WorkerRequest, xfer: Transfer | None, then: Callable[[], None]
    ) -> bool:
        """A read still in flight may land in the request's blocks: keep them out of use until it
        ends, then run ``then``, and continue the request (if at all) under a fresh engine id.
        True if it did so."""
        if xfer is None or xfer.done():
            return False
        c = self.core
        max_wait_s = c.config.transfer.timeout_s + c.config.transfer.lease_grace_s
        c.quarantine.hold_read(rec.engine_id, xfer, max_wait_s, then)
        c.table.rekey(rec, f"{rec.request_id}:recompute")
        return True

    async def _start(self, rec: WorkerRequest, first_token: int) -> None:
        engine_id = rec.engine_id
        await self.core.loop.call_now(lambda: self.core.engine.start_decode(engine_id, first_token))


async def _wait(xfer: Transfer, timeout_s: float) -> None:
    """Wait for a transfer without blocking the event loop (no thread hop if it is already done)."""
    if xfer.done():
        xfer.wait(0.0)
        return
    await asyncio.to_thread(xfer.wait, timeout_s)
