"""The engine worker: one engine, one transfer agent, one engine loop; and its Ray actor shell.

``EngineWorker`` is a plain class (tests drive it without Ray). ``WorkerActor`` is the same class
as a Ray actor; the coordinator creates it inside a placement-group bundle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from moriio_ray import metrics
from moriio_ray.engine.engine import Engine
from moriio_ray.errors import RequestCancelled, TransferError
from moriio_ray.runtime.kv_pull import KVPuller
from moriio_ray.runtime.messages import (
    GenRequest,
    KVHandle,
    PushResult,
    Reservation,
    TokenChunk,
)
from moriio_ray.runtime.push import LayerPusher
from moriio_ray.runtime.streaming import stream_outputs, wait_prefill
from moriio_ray.runtime.worker_base import WorkerBase, reserve_blocks

log = logging.getLogger(__name__)


class EngineWorker(WorkerBase):
    """The role methods: colocated ``generate``; READ ``prefill``/``decode``/``release``; WRITE
    ``reserve``/``prefill_push``; and ``deliver``, through which P hands its result to D."""

    # -- colocated ------------------------------------------------------------------------------

    async def generate(self, req: GenRequest) -> AsyncIterator[TokenChunk]:
        """Colocated: prefill and decode here; stream the tokens."""
        self.counters["requests"] += 1
        q = self.loop.subscribe(req.request_id)
        try:
            await self.loop.call(
                lambda: self.engine.add_request(req.request_id, req.prompt_token_ids, req.params)
            )
            async for chunk in stream_outputs(q, self.config.runtime.remote_timeout_s):
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            self.counters["cancelled"] += 1
            raise
        finally:
            self._finish(req.request_id)

    # -- READ mode ------------------------------------------------------------------------------

    async def prefill(self, req: GenRequest, deliver_to: Any = None) -> KVHandle:
        """Prefill, sample the first token, lease the prompt's blocks and return the handle.

        ``deliver_to``: the decode worker to hand the handle to at once (one Ray call, P -> D).
        """
        self.counters["requests"] += 1
        q = self.loop.subscribe(req.request_id)
        ok = False
        try:
            await self.loop.call(
                lambda: self.engine.add_request(req.request_id, req.prompt_token_ids, req.params)
            )
            out, prefill_s = await wait_prefill(q, self.config.runtime.remote_timeout_s)
            self._check_not_cancelled(req.request_id)
            assert out.prefill is not None
            pre = out.prefill
            handle = KVHandle(
                transfer_id=req.request_id,
                engine_key=self.key,
                epoch=self.epoch,
                block_ids=list(pre.block_ids),
                num_tokens=pre.num_tokens,
                first_token=pre.first_token,
                first_logprob=pre.first_logprob,
                lease_deadline_unix=pre.lease_deadline_unix,
                prefill_done_unix=time.time(),
                prefill_s=prefill_s,
                # a prefill engine always ends the request at its first token; a finish reason
                # says that the first token already completed it (EOS, stop, max_tokens == 1)
                finished=out.finish_reason is not None,
                finish_reason=out.finish_reason,
            )
            if deliver_to is not None:
                deliver_to.deliver.remote(req.request_id, handle)
            ok = True
            return handle
        except asyncio.CancelledError:
            self.counters["cancelled"] += 1
            raise
        finally:
            self.loop.unsubscribe(req.request_id)
            if not ok:  # cancelled or failed: free the blocks (and any lease) at once
                self.loop.post(lambda: self.engine.abort(req.request_id))

    async def release(self, transfer_id: str) -> bool:
        """D has read (or given up on) a lease: free P's blocks now."""
        released: bool = await self.loop.call(lambda: self.engine.release(transfer_id))
        return released

    async def decode(
        self, req: GenRequest, source: KVHandle | PushResult | None = None
    ) -> AsyncIterator[TokenChunk]:
        """Bring the prompt's KV in (READ: one batched read; WRITE: already pushed), then decode.

        ``source`` None: wait for P to deliver it (``deliver``). The stream carries the tokens
        after the first one (the caller already has the first).
        """
        self.counters["requests"] += 1
        rid = req.request_id
        q = self.loop.subscribe(rid)
        timings: dict[str, float] = {}
        puller: KVPuller | None = None
        try:
            if source is None:
                source, arrived_unix = await self.mailbox.take(rid, self.config.runtime.remote_timeout_s)
            else:
                arrived_unix = time.time()
            timings["decode_enter_unix"] = arrived_unix
            if source.finished:  # the first token already ended the request: nothing to decode
                self._reservations.pop(rid, None)
                return
            first: int | None
            if isinstance(source, KVHandle):
                puller = KVPuller(self, req, source, timings)
                pulled = await puller.run()
                first, first_lp = pulled.first_token, pulled.first_logprob
                if pulled.queue is not None:  # recomputed locally (maybe under a fresh id)
                    if pulled.request_id != rid:
                        self.loop.unsubscribe(rid)
                    rid, q = pulled.request_id, pulled.queue
            else:
                res = self._reservations.pop(rid, None)
                if res is None:
                    raise TransferError(f"request {rid!r}: no reservation on {self.key} (expired?)")
                first, first_lp = source.first_token, source.first_logprob
                timings["push_wait_s"] = source.push_wait_s
            if first is not None:
                # Not awaited through the engine thread when the engine is between steps; a
                # failure reaches the stream through the request's queue either way.
                try:
                    await self.loop.call_now(_accept(self.engine, rid, first, first_lp, timings))
                except Exception as exc:
                    q.put_nowait(exc)
            else:
                timings["decode_start_unix"] = time.time()
            if puller is not None:
                puller.release()  # after the hand-over: the Ray call is off the critical path
            async for chunk in stream_outputs(q, self.config.runtime.remote_timeout_s, skip_first=True):
                if chunk.timings is None and timings:
                    chunk.timings, timings = dict(timings), {}
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            self.counters["cancelled"] += 1
            raise
        finally:
            late = self.mailbox.abandon(req.request_id)
            if isinstance(late, KVHandle):  # delivered but never read here: free P's lease
                self._release_lease(late)
            self._reservations.pop(req.request_id, None)
            self._finish(rid)
            if rid != req.request_id:
                self._finish(req.request_id)

    async def deliver(self, request_id: str, source: KVHandle | PushResult) -> None:
        """P hands over its prefill result for a decode that waits here (or will)."""
        if not self.mailbox.deliver(request_id, source) and isinstance(source, KVHandle):
            self._release_lease(source)  # a duplicate (retried prefill) or an abandoned request

    # -- WRITE mode -----------------------------------------------------------------------------

    async def reserve(self, req: GenRequest) -> Reservation:
        """Reserve blocks for a prompt that P will push into."""
        deadline_s = time.monotonic() + self.config.runtime.remote_timeout_s
        blocks = await reserve_blocks(self, req, deadline_s)
        try:
            self._check_not_cancelled(req.request_id)
        except RequestCancelled:
            self.loop.post(lambda: self.engine.abort(req.request_id))
            raise
        res = Reservation(
            request_id=req.request_id,
            engine_key=self.key,
            epoch=self.epoch,
            block_ids=blocks,
            deadline_unix=time.time() + self.config.transfer.kv_lease_s,
        )
        self._reservations[req.request_id] = res
        asyncio.get_running_loop().call_later(
            self.config.transfer.kv_lease_s + self.config.transfer.lease_grace_s,
            self._expire_reservation,
            req.request_id,
        )
        return res

    async def cancel_reservation(self, request_id: str) -> bool:
        """Free a reservation; one still being made is freed as soon as it is (no race)."""
        self._mark_cancelled(request_id)
        if self._reservations.pop(request_id, None) is None:
            return False
        await self.loop.call(lambda: self.engine.abort(request_id))
        return True

    def _expire_reservation(self, request_id: str) -> None:
        if self._reservations.pop(request_id, None) is not None:
            log.warning("reservation %s expired unused; freeing its blocks", request_id)
            self.loop.post(lambda: self.engine.abort(request_id))

    async def prefill_push(
        self, req: GenRequest, reservation: Reservation, deliver_to: Any = None
    ) -> PushResult:
        """Prefill while pushing each computed layer into D's reserved blocks; then free ours.

        ``deliver_to``: the decode worker to hand the result to at once (one Ray call, P -> D).
        """
        self.counters["requests"] += 1
        rid = req.request_id
        peer = await self.peers.get(reservation.engine_key, reservation.epoch)
        pusher = LayerPusher(self.agent, self.kv_mem, self.layout, peer.info, reservation)
        self._pushers[rid] = pusher
        q = self.loop.subscribe(rid)
        try:
            await self.loop.call(lambda: self.engine.add_request(rid, req.prompt_token_ids, req.params))
            out, prefill_s = await wait_prefill(q, self.config.runtime.remote_timeout_s)
            assert out.prefill is not None
            done_unix = time.time()
            t0 = time.perf_counter()
            limit_s = max(0.0, min(self.config.transfer.timeout_s, reservation.deadline_unix - done_unix))
            try:
                await asyncio.to_thread(pusher.wait_all, limit_s)
            except Exception as exc:
                self.counters["transfer_failures"] += 1
                metrics.record_failure(type(exc).__name__, role=self.role)
                raise
            push_wait_s = time.perf_counter() - t0
            self.counters["transfers"] += 1
            self.counters["transfer_bytes"] += pusher.num_bytes
            metrics.record_transfer(
                pusher.num_bytes,
                prefill_s,
                pusher.num_segments,
                backend=self.agent.name,
                role=self.role,
            )
            result = PushResult(
                request_id=rid,
                first_token=out.prefill.first_token,
                first_logprob=out.prefill.first_logprob,
                prefill_done_unix=done_unix,
                prefill_s=prefill_s,
                push_wait_s=push_wait_s,
                num_bytes=pusher.num_bytes,
                num_segments=pusher.num_segments,
                finished=out.finish_reason is not None,
                finish_reason=out.finish_reason,
            )
            if deliver_to is not None:
                deliver_to.deliver.remote(rid, result)
            return result
        finally:
            self._pushers.pop(rid, None)
            self.loop.unsubscribe(rid)
            # P keeps nothing once the push is over (or failed): D holds the KV now.
            self.loop.post(lambda: self.engine.abort(rid))

    def _on_layer(self, layer: int, request_ids: list[str]) -> None:
        # engine thread: push this layer for every request of the batch that has a destination
        for rid in request_ids:
            pusher = self._pushers.get(rid)
            if pusher is not None:
                pusher.on_layer(layer, self.engine.prefill_blocks(rid))


def _accept(
    engine: Engine, rid: str, first: int, first_lp: float | None, timings: dict[str, float]
) -> Callable[[], None]:
    """The engine-thread call that joins a request to decoding, timestamped where it happens."""

    def run() -> None:
        engine.start_decode(rid, first, first_lp)
        timings["decode_start_unix"] = time.time()

    return run


def make_actor_class() -> Any:
    """The Ray actor of EngineWorker (built lazily so that importing this module needs no Ray)."""
    import ray

    return ray.remote(EngineWorker)
