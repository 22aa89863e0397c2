"""The request flows, driven from the caller's side (a driver or the Serve ingress).

READ:  P.prefill(req, D) and D.decode(req) start together; P hands its KVHandle straight to D
       (D.deliver), D reads once and releases P's lease; the caller's copy gives the first token.
WRITE: D.reserve, then P.prefill_push(req, reservation, D) and D.decode(req); P pushes each layer
       into D's blocks and hands its PushResult straight to D.
COLOCATED: C.generate streams.

Failure rules (DESIGN section 6): every remote await has a deadline; a prefill whose P dies is
retried once on another P; a decode whose D dies ends with PeerLost, or (``on_transfer_failure:
recompute``) continues on another pair from the tokens already produced; a cancelled request
releases P's blocks at once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import ray

from moriio_ray.config import PipelineConfig
from moriio_ray.errors import PeerLost
from moriio_ray.runtime.deadline import deadline
from moriio_ray.runtime.messages import GenRequest, KVHandle, Member, PushResult, TokenChunk
from moriio_ray.runtime.router import Router

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class FlowState:
    """What one request's flow has produced so far (read by the pipeline for results and timings)."""

    emitted: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    prefill_key: str | None = None
    decode_key: str | None = None
    retries: int = 0
    dead: set[str] = field(default_factory=set)  # workers seen dead: no retry goes to them


class Flows:
    """Runs requests over the pool through a router; reports dead workers to the coordinator."""

    def __init__(self, config: PipelineConfig, router: Router, coordinator: Any) -> None:
        self.config = config
        self.router = router
        self.coordinator = coordinator
        self.timeout_s = config.runtime.remote_timeout_s
        self.counters = {"prefill_retries": 0, "continuations": 0, "peer_lost": 0}

    def _dead(self, member: Member) -> None:
        self.coordinator.report_failure.remote(member.key, member.epoch)

    async def run(self, req: GenRequest, state: FlowState) -> AsyncGenerator[TokenChunk, None]:
        """Stream the request's chunks; the first chunk holds the first token."""
        mode = self.config.mode
        budget = req.params.max_tokens
        attempt = req
        while True:
            try:
                if mode == "colocated":
                    gen = self._colocated(attempt, state)
                elif mode == "write":
                    gen = self._write(attempt, state)
                else:
                    gen = self._read(attempt, state)
                async with contextlib.aclosing(gen) as chunks:
                    async for chunk in chunks:
                        state.emitted.extend(chunk.token_ids)
                        yield chunk
                return
            except ray.exceptions.RayActorError as exc:
                # The decode side died mid-stream (prefill deaths are retried inside the flows).
                if self.config.transfer.on_transfer_failure != "recompute" or state.retries >= 1:
                    self.counters["peer_lost"] += 1
                    raise PeerLost(f"the worker serving {req.request_id} died: {exc}") from None
                state.retries += 1
                self.counters["continuations"] += 1
                left = budget - len(state.emitted)
                if left <= 0:
                    return
                log.warning("continuing %s on another pair after a worker death", req.request_id)
                attempt = GenRequest(
                    request_id=f"{req.request_id}:cont{state.retries}",
                    prompt_token_ids=[*req.prompt_token_ids, *state.emitted],
                    params=_with_max_tokens(req.params, left),
                )

    # -- colocated ------------------------------------------------------------------------------

    async def _colocated(self, req: GenRequest, state: FlowState) -> AsyncGenerator[TokenChunk, None]:
        worker = self.router.pick("colocated", exclude=state.dead)
        cost = len(req.prompt_token_ids) + req.params.max_tokens
        self.router.acquire(worker, cost)
        state.decode_key = worker.key
        try:
            stream = self._stream(worker, worker.actor.generate.remote(req), state)
            async with contextlib.aclosing(stream) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self.router.release(worker, cost)

    # -- READ -----------------------------------------------------------------------------------

    async def _read(self, req: GenRequest, state: FlowState) -> AsyncGenerator[TokenChunk, None]:
        # D's decode starts together with P's prefill and waits for P to hand it the KVHandle
        # directly (P -> D, one Ray call); the caller's own copy of the handle gives the first token.
        p0 = self.router.pick("prefill", exclude=state.dead)
        d = self.router.pick_decode_for(p0, exclude=state.dead)
        state.decode_key = d.key
        cost = req.params.max_tokens
        self.router.acquire(d, cost)
        gens: list[Any] = []
        released = False
        done = False
        handle: KVHandle | None = None
        p: Member | None = None

        def start_decode() -> None:
            if not gens:
                gens.append(d.actor.decode.remote(req, None))

        try:
            handle, p = await self._on_prefill_worker(
                req,
                state,
                lambda attempt: p0 if attempt == 0 else self.router.pick_prefill_for(d, exclude=state.dead),
                lambda p: p.actor.prefill.remote(req, d.actor),
                "prefill",
                on_submit=start_decode,
            )
            state.timings["prefill_s"] = handle.prefill_s
            done = handle.finished  # set before each yield: the consumer may close us there
            yield _first_chunk(handle.first_token, handle.first_logprob, handle.finish_reason)
            if not handle.finished:
                async with contextlib.aclosing(self._stream(d, gens[0], state)) as chunks:
                    async for chunk in chunks:
                        released = True  # D released the lease once it had read
                        done = chunk.finished
                        _handoff(state, chunk, handle.prefill_done_unix)
                        yield chunk
            done = True
        finally:
            self.router.release(d, cost)
            if gens and not done:
                _cancel(gens[0])  # stopped before D's stream was read to its end
            if handle is not None and p is not None and not released:
                # finished at P, cancelled or failed before D read: free P's blocks now
                p.actor.release.remote(handle.transfer_id)

    async def _on_prefill_worker(
        self,
        req: GenRequest,
        state: FlowState,
        pick: Callable[[int], Member],
        call: Callable[[Member], Any],
        what: str,
        on_submit: Callable[[], None] | None = None,
    ) -> tuple[Any, Member]:
        """Run ``call(P)`` on ``pick(attempt)``; if P dies, once more on another (failure rule)."""
        for attempt in range(self.config.runtime.prefill_retries + 1):
            p = pick(attempt)
            state.prefill_key = p.key
            cost = len(req.prompt_token_ids)
            self.router.acquire(p, cost)
            ref = call(p)
            if on_submit is not None:
                on_submit()
            try:
                return await deadline(ref, self.timeout_s, f"{what} on {p.key}"), p
            except ray.exceptions.RayActorError:
                self._dead(p)
                state.dead.add(p.key)
                if attempt >= self.config.runtime.prefill_retries:
                    raise
                self.counters["prefill_retries"] += 1
                log.warning("%s of %s: %s died, retrying on another P", what, req.request_id, p.key)
            except BaseException:
                # Cancelled or timed out: stop P's task, and tell P to free the request's blocks
                # in case the task had already finished (its handle then reaches nobody).
                _cancel(ref)
                p.actor.abort.remote(req.request_id)
                raise
            finally:
                self.router.release(p, cost)
        raise AssertionError("unreachable")

    # -- WRITE ----------------------------------------------------------------------------------

    async def _write(self, req: GenRequest, state: FlowState) -> AsyncGenerator[TokenChunk, None]:
        d = self.router.pick("decode", exclude=state.dead)
        state.decode_key = d.key
        cost = req.params.max_tokens + len(req.prompt_token_ids)
        self.router.acquire(d, cost)
        gens: list[Any] = []
        done = False

        def start_decode() -> None:  # D waits for P to hand it the PushResult directly
            if not gens:
                gens.append(d.actor.decode.remote(req, None))

        try:
            res = await deadline(d.actor.reserve.remote(req), self.timeout_s, f"reserve on {d.key}")
            push: PushResult
            push, _p = await self._on_prefill_worker(
                req,
                state,
                lambda _attempt: self.router.pick_prefill_for(d, exclude=state.dead),
                lambda p: p.actor.prefill_push.remote(req, res, d.actor),
                "prefill_push",
                on_submit=start_decode,
            )
            state.timings["prefill_s"] = push.prefill_s
            done = push.finished  # set before each yield: the consumer may close us there
            yield _first_chunk(push.first_token, push.first_logprob, push.finish_reason)
            if not push.finished:
                async with contextlib.aclosing(self._stream(d, gens[0], state)) as chunks:
                    async for chunk in chunks:
                        done = chunk.finished
                        _handoff(state, chunk, push.prefill_done_unix)
                        yield chunk
            done = True
        finally:
            self.router.release(d, cost)
            if not done:
                # Stopped early: D's decode may not have started (a cancelled task never runs, and
                # would leave the reservation to its expiry), so cancel the reservation as well.
                if gens:
                    _cancel(gens[0])
                d.actor.cancel_reservation.remote(req.request_id)

    # -- streaming ------------------------------------------------------------------------------

    async def _stream(self, worker: Member, gen: Any, state: FlowState) -> AsyncGenerator[TokenChunk, None]:
        """Iterate a worker's streaming generator with a deadline per chunk; cancel it if we stop early."""
        finished = False
        try:
            while True:
                try:
                    ref = await deadline(gen.__anext__(), self.timeout_s, f"stream from {worker.key}")
                except StopAsyncIteration:
                    return
                chunk: TokenChunk = await deadline(ref, self.timeout_s, f"chunk from {worker.key}")
                # Mark the end before yielding it: the consumer may close us right there.
                finished = chunk.finished
                yield chunk
                if finished:
                    return
        except ray.exceptions.RayActorError:
            self._dead(worker)
            state.dead.add(worker.key)
            raise
        finally:
            if not finished:
                _cancel(gen)


def _cancel(ref: Any) -> None:
    """Cancel a worker's task, but not the calls it made itself (a lease release to P, ...)."""
    ray.cancel(ref, recursive=False)


def _first_chunk(token: int, logprob: float | None, finish_reason: str | None) -> TokenChunk:
    return TokenChunk(
        token_ids=[token],
        logprobs=[logprob] if logprob is not None else None,
        finished=finish_reason is not None,
        finish_reason=finish_reason,
    )


def _handoff(state: FlowState, chunk: TokenChunk, prefill_done_unix: float) -> None:
    """The first decode chunk carries D's timings: derive the handoff overhead from them.

    handoff = D accepts the request for decoding - P finished prefill - raw transfer time, split
    into the trip from P through the caller to D (``handoff_rpc_s``) and D's own work around the
    transfer (reserve, plan, release, hand-over: ``handoff_local_s``).
    """
    t = chunk.timings
    if not t or "decode_start_unix" not in t or "handoff_s" in state.timings:
        return
    read_s = t.get("transfer_s", 0.0)  # READ: D's read, between entering and accepting
    raw_s = read_s + t.get("push_wait_s", 0.0)  # WRITE: P's wait for its pushes, before returning
    state.timings.update({k: v for k, v in t.items() if not k.endswith("_unix")})
    total_s = max(0.0, t["decode_start_unix"] - prefill_done_unix - raw_s)
    state.timings["handoff_s"] = total_s
    if "decode_enter_unix" in t:
        local_s = max(0.0, t["decode_start_unix"] - t["decode_enter_unix"] - read_s)
        state.timings["handoff_local_s"] = local_s
        state.timings["handoff_rpc_s"] = max(0.0, total_s - local_s)


def _with_max_tokens(params: Any, max_tokens: int) -> Any:
    return msgspec.structs.replace(params, max_tokens=max_tokens)
