"""D's part of a worker: take P's hand-over, bring the prompt's KV in, join the decode batch.

P calls ``deliver`` once its prefill is done (one Ray call, P -> D); the call returns once P's blocks
are no longer needed, which tells P to free its lease (P is the one owner of that release).
READ: reserve blocks, plan one coalesced batch of segments, issue one read inside P's lease
(never past ``lease deadline - read_margin_s``), start decoding. With prefix caching the
reservation starts with the blocks D holds already (its own cached prefix): the read covers only the
rest, the tail, and a prompt D holds whole needs no read at all. D's blocks and P's are the prompt's
blocks on both sides, so their counts agree.
A read that fails or runs late recomputes the prompt here (``on_transfer_failure: recompute``) or ends the
request with its typed error (``fail``) on the caller's stream; blocks that a read still in flight
may write are quarantined until it has ended, also when the request is cancelled mid-read, and
``deliver`` returns (P's lease goes) only then: the read may still be reading P's blocks.
WRITE: P reserved the blocks (``reserve``) and pushed every layer; decoding starts at once. A
request that ends before P's result came keeps its reservation quarantined until P says its pushes
have ended (``WorkerCore.pushes_ended``), or until the reservation's deadline plus grace.
D's hand-over timings (``DecodeStart``) ride on the request's first output on the caller's stream.
Tensor parallelism: each rank of this engine reads, from every P rank holding some of its KV heads,
one batched read (``tp_transfer``); the one read is then all of them, under the same deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from moriio_ray import metrics
from moriio_ray.errors import DeadlineExceeded, MoriioRayError, TransferError, TransferTimeout
from moriio_ray.protocol.messages import (
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


class _Lease:
    """P's lease on the blocks a read comes from: ``free`` ends the ``deliver`` call that P waits
    on. ``held``: the quarantine frees it once a read still in flight has ended."""

    def __init__(self) -> None:
        self.freed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.held = False

    def free(self) -> None:
        if not self.freed.done():
            self.freed.set_result(None)


class DecodeSide:
    """Takes requests whose prompt another engine ran; their tokens go to the caller's stream."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core
        self._own_ranks: list[RankDesc] | None = None

    async def _ranks(self) -> list[RankDesc]:
        """This engine's ranks (rank 0 alone at TP = 1), as P's ranks are matched against them."""
        if self._own_ranks is None:
            c = self.core
            self._own_ranks = [c.rank0(), *(await c.group.descs() if c.group is not None else [])]
        return self._own_ranks

    async def reserve(self, req: GenRequest, caller: str | None = None) -> Reservation:
        """WRITE (called by P): reserve blocks for a prompt that P will push into; the request's
        tokens go to ``caller``'s stream once P's result has come (``deliver``)."""
        c = self.core
        rec = c.table.open(req.request_id, caller)
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
        # no result came for the reservation (P failed, or nobody asked P to push into it)
        if rec.reservation is not None and self.core.table.get(rec.request_id) is rec:
            log.warning("reservation %s expired unused; freeing its blocks", rec.request_id)
            self.core.discard(rec)

    async def deliver(self, req: GenRequest, source: Handoff, caller: str) -> None:
        """P's hand-over: bring the KV in and join the batch; the tokens after the first (the
        caller has that one from P) go to ``caller``'s output stream. Returns once P's blocks are
        no longer needed (READ: the read has ended, or never starts)."""
        c = self.core
        handoff_unix = time.time()
        if isinstance(source, PushResult):  # every push has landed
            c.pushes_ended(req.request_id)
            found = c.table.get(req.request_id)
            if found is None or found.reservation is None:
                exc = TransferError(f"request {req.request_id!r}: no reservation on {c.key} (expired?)")
                if found is None:  # (else a duplicate: the request decodes already)
                    c.fail(WorkerRequest(req.request_id, req.request_id, caller), exc)
                raise exc
            rec = found
        else:  # a cancel that came first refuses it (RequestCancelled): P frees its lease
            rec = c.table.open(req.request_id, caller)
        c.counters["requests"] += 1
        lease = _Lease()
        if isinstance(source, PushResult):
            lease.free()  # P holds nothing for D
        # the request's own task: a cancel (the caller's abort) stops it, not this call
        rec.task = task = c.spawn(self._run(rec, req, source, handoff_unix, lease))
        task.add_done_callback(lambda _t: self._ended(rec, task, lease))
        await asyncio.shield(lease.freed)

    def _ended(self, rec: WorkerRequest, task: asyncio.Task[bool], lease: _Lease) -> None:
        """The request's task has ended (also one cancelled before it ran, which never entered
        its body): forget a request that does not decode, and free P's lease unless a read still
        in flight holds it."""
        rec.task = None
        if task.cancelled() or not task.result():
            self.core.discard(rec)
        if not lease.held:
            lease.free()

    async def _run(
        self, rec: WorkerRequest, req: GenRequest, source: Handoff, handoff_unix: float, lease: _Lease
    ) -> bool:
        """True once the request decodes; its clean-up is ``_ended``'s."""
        try:
            rec.check_cancelled()
            if isinstance(source, KVHandle):
                await self._pull(rec, req, source, handoff_unix, lease)
            else:
                rec.reservation = None
                await self._start(rec, source.first_token, DecodeStart(handoff_unix=handoff_unix))
            return True
        except asyncio.CancelledError:
            return False  # the caller aborted: nobody reads the stream
        except BaseException as exc:  # the caller hears it on its stream
            self.core.fail(rec, exc)
            return False

    async def _pull(
        self, rec: WorkerRequest, req: GenRequest, h: KVHandle, handoff_unix: float, lease: _Lease
    ) -> None:
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
            t0 = time.perf_counter()
            if held < len(blocks):  # read only the tail that D's cache lacks
                assert c.engine.kv_mem is not None
                peer = await c.peers.get(h.engine_key, h.epoch)
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
            self._quarantine_if_running(rec, xfer, lease)
            raise
        except (MoriioRayError, TimeoutError) as exc:
            await self._recompute(rec, req, h, exc, xfer, handoff_unix, lease)
            return
        lease.free()  # the read has ended: P's lease goes
        if xfer is None:  # D held the whole prompt: nothing moved
            await self._start(rec, h.first_token, DecodeStart(handoff_unix=handoff_unix))
            return
        start = DecodeStart(
            handoff_unix=handoff_unix,
            transfer_s=transfer_s,
            transfer_bytes=xfer.num_bytes,
            transfer_segments=xfer.num_segments,
        )
        await self._start(rec, h.first_token, start)
        c.counters["transfers"] += 1
        c.counters["transfer_bytes"] += xfer.num_bytes
        metrics.record_transfer(
            xfer.num_bytes, transfer_s, xfer.num_segments, backend=c.agent.name, role="decode"
        )

    async def _recompute(
        self,
        rec: WorkerRequest,
        req: GenRequest,
        h: KVHandle,
        exc: BaseException,
        xfer: Transfer | None,
        handoff_unix: float,
        lease: _Lease,
    ) -> None:
        c = self.core
        kind = type(exc).__name__
        log.warning("%s: KV read for %s failed (%s): %s", c.key, rec.request_id, kind, exc)
        c.counters["transfer_failures"] += 1
        metrics.record_failure(kind, role="decode")
        # a read still running (it timed out) keeps its blocks here, and P's lease, until it ends
        held = self._quarantine_if_running(rec, xfer, lease)
        if not held:
            lease.free()
        if c.config.transfer.on_transfer_failure == "fail" or isinstance(exc, DeadlineExceeded):
            raise exc  # fail, or no blocks came for the request at all
        if held:
            deadline_s = time.monotonic() + c.config.runtime.remote_timeout_s
            try:
                await c.reserve_blocks(req, rec.engine_id, deadline_s)
            except DeadlineExceeded:
                raise TransferError(f"{c.key}: no blocks to recompute {rec.request_id}") from None
        rec.start = DecodeStart(handoff_unix=handoff_unix, decode_start_unix=time.time(), recomputed=True)
        await c.loop.call(lambda: c.engine.recompute_reserved(rec.engine_id, h.first_token))
        c.counters["recomputes"] += 1

    def _quarantine_if_running(self, rec: WorkerRequest, xfer: Transfer | None, lease: _Lease) -> bool:
        """A read still in flight may land in the request's blocks: keep them out of use until it
        ends, then free P's lease, and continue the request (if at all) under a fresh engine id.
        True if it did so."""
        if xfer is None or xfer.done():
            return False
        c = self.core
        max_wait_s = c.config.transfer.timeout_s + c.config.transfer.lease_grace_s
        lease.held = True
        c.quarantine.hold_read(rec.engine_id, xfer, max_wait_s, lease.free)
        c.table.rekey(rec, f"{rec.request_id}:recompute")
        return True

    async def _start(self, rec: WorkerRequest, first_token: int, start: DecodeStart) -> None:
        """Join the decode batch; ``start`` (its time set here) rides on the first output."""
        engine = self.core.engine
        engine_id = rec.engine_id

        def join() -> None:
            rec.start = msgspec.structs.replace(start, decode_start_unix=time.time())
            engine.start_decode(engine_id, first_token)

        await self.core.loop.call_now(join)


async def _wait(xfer: Transfer, timeout_s: float) -> None:
    """Wait for a transfer without blocking the event loop (no thread hop if it is already done)."""
    if xfer.done():
        xfer.wait(0.0)
        return
    await asyncio.to_thread(xfer.wait, timeout_s)
