"""The request flows, driven from the caller's side (a driver or the Serve ingress).

Disaggregated (READ and WRITE, one function with numbered steps; ``Mode`` holds the differences):
  1. pick D (READ: P first, then a D that can reach it);
  2. WRITE: D reserves the blocks P will push into;
  3. subscribe to D's output stream and start ``D.decode``, which waits for P's hand-over;
  4. P prefills and hands its result straight to D (one Ray call, P -> D), retried once on
     another P if P dies;
  5. the first token, sampled on P, goes to the caller from P's result (D never sends it again);
  6. once D has the KV and decodes, its tokens come on the stream.
  If the caller stops early, D and P are told to abort: their blocks and P's lease are freed at once.
Colocated: ``C.generate`` prefills and answers with the first token; the later ones come on the stream.

Failure rules: every remote await has a deadline; a prefill whose P dies is retried once on another
P; a decode whose D dies ends with PeerLost, or (``on_transfer_failure: recompute``) continues on
another pair from the tokens already produced.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import ray

from moriio_ray.config import PipelineConfig
from moriio_ray.engine.outputs import PromptLogprobs
from moriio_ray.errors import PeerLost
from moriio_ray.runtime.deadline import deadline
from moriio_ray.runtime.detached import send
from moriio_ray.runtime.messages import (
    DecodeStart,
    GenRequest,
    Handoff,
    Member,
    PeerRef,
    PushResult,
    RequestOutput,
    Reservation,
    Timings,
)
from moriio_ray.runtime.router import Router
from moriio_ray.runtime.streams import OutputStreams, Subscription

log = logging.getLogger(__name__)


@dataclass
class TokenChunk:
    """New tokens of one request, as the flows hand them to the pipeline."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, its alternatives
    prompt_logprobs: PromptLogprobs | None = None  # with the first token, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class FlowState:
    """What one request's flow has produced so far (read by the pipeline for results and timings)."""

    emitted: list[int] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    prefill_key: str | None = None
    decode_key: str | None = None
    retries: int = 0
    dead: set[str] = field(default_factory=set)  # workers seen dead: no retry goes to them


@dataclass(frozen=True)
class Mode:
    """What tells READ from WRITE."""

    name: str
    reserve_first: bool  # WRITE: D reserves blocks before P runs
    p_first: bool  # READ: pick P, then a D that can reach it
    call: Callable[[Member, GenRequest, Reservation | None, Member], Any]  # P's Ray call


MODES = {
    "read": Mode("read", False, True, lambda p, req, _res, d: p.actor.prefill.remote(req, _ref(d))),
    "write": Mode(
        "write", True, False, lambda p, req, res, d: p.actor.prefill_push.remote(req, res, _ref(d))
    ),
}


class Flows:
    """Runs requests over the pool through a router; reports dead workers to the coordinator."""

    def __init__(self, config: PipelineConfig, router: Router, coordinator: Any) -> None:
        self.config = config
        self.router = router
        self.coordinator = coordinator
        self.timeout_s = config.runtime.remote_timeout_s
        self.counters = {"prefill_retries": 0, "continuations": 0, "peer_lost": 0}

    async def run(
        self, req: GenRequest, state: FlowState, streams: OutputStreams
    ) -> AsyncGenerator[TokenChunk, None]:
        """Stream the request's chunks; the first chunk holds the first token."""
        budget = req.params.max_tokens
        attempt = req
        while True:
            try:
                if self.config.mode == "colocated":
                    gen = self._colocated(attempt, state, streams)
                else:
                    gen = self._disaggregated(attempt, state, streams, MODES[self.config.mode])
                async with contextlib.aclosing(gen) as chunks:
                    async for chunk in chunks:
                        state.emitted.extend(chunk.token_ids)
                        yield chunk
                return
            except ray.exceptions.RayActorError as exc:
                # The decode side died mid-stream (prefill deaths are retried inside the flow).
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
                    params=msgspec.structs.replace(
                        req.params,
                        max_tokens=left,
                        min_tokens=max(0, req.params.min_tokens - len(state.emitted)),
                    ),
                    sample_offset=req.sample_offset + len(state.emitted),  # the same seeded draws
                )

    # -- colocated ------------------------------------------------------------------------------

    async def _colocated(
        self, req: GenRequest, state: FlowState, streams: OutputStreams
    ) -> AsyncGenerator[TokenChunk, None]:
        c = self.router.pick("colocated", exclude=state.dead)
        state.decode_key = c.key
        cost = len(req.prompt_token_ids) + req.params.max_tokens
        self.router.acquire(c, cost)
        sub = streams.open(c, req.request_id)
        done = False
        try:
            ref = c.actor.generate.remote(req, streams.caller_id)
            out: RequestOutput = await self._call(c, ref, "generate", state)
            state.timings.cached_tokens = out.num_cached_tokens
            first = _merge([out])
            done = first.finished
            yield first
            if done:
                return
            async for chunk in self._stream(c, sub, state):
                done = chunk.finished  # set before each yield: the consumer may close us there
                yield chunk
        finally:
            sub.close()
            self.router.release(c, cost)
            if not done:
                send(c.actor.abort, req.request_id)

    # -- disaggregated --------------------------------------------------------------------------

    async def _disaggregated(
        self, req: GenRequest, state: FlowState, streams: OutputStreams, mode: Mode
    ) -> AsyncGenerator[TokenChunk, None]:
        rid = req.request_id
        # 1. Pick D (READ: P first, then a D that can reach it).
        p0 = self.router.pick("prefill", exclude=state.dead) if mode.p_first else None
        d = (
            self.router.pick_decode_for(p0, exclude=state.dead)
            if p0 is not None
            else self.router.pick("decode", exclude=state.dead)
        )
        state.decode_key = d.key
        cost = req.params.max_tokens + (0 if mode.p_first else len(req.prompt_token_ids))
        self.router.acquire(d, cost)
        sub = streams.open(d, rid)
        asked: list[Member] = []  # every P asked to prefill it (WRITE: to push into D's blocks)
        decode_ref: Any = None
        done = False
        try:
            # 2. WRITE: D reserves the blocks P will push into.
            reservation = None
            if mode.reserve_first:
                reservation = await self._call(d, d.actor.reserve.remote(req), "reserve", state)
            # 3. D starts waiting for P's hand-over.
            decode_ref = d.actor.decode.remote(req, streams.caller_id)

            # 4. P prefills and hands its result straight to D (once more on another P if P dies).
            def pick(attempt: int) -> Member:
                if attempt == 0 and p0 is not None:
                    return p0
                return self.router.pick_prefill_for(d, exclude=state.dead)

            result, _p = await self._prefill(
                req, state, pick, lambda p: mode.call(p, req, reservation, d), asked
            )
            state.timings.prefill_s = result.prefill_s
            state.timings.cached_tokens = result.num_cached_tokens
            if isinstance(result, PushResult):  # WRITE: what P pushed (D's cached blocks excepted)
                state.timings.push_wait_s = result.push_wait_s
                state.timings.transfer_bytes = result.num_bytes
            # 5. The first token, from P's result.
            done = result.finish_reason is not None
            first_top = [result.first_top_logprobs] if result.first_top_logprobs is not None else None
            yield TokenChunk(
                [result.first_token],
                _lp(result.first_logprob),
                result.finish_reason,
                first_top,
                result.prompt_logprobs,
            )
            if done:
                return
            # 6. D has the KV and decodes; its tokens follow on the stream.
            start: DecodeStart = await self._call(d, decode_ref, "decode", state)
            decode_ref = None
            state.timings.add_handoff(result.prefill_done_unix, start)
            async for chunk in self._stream(d, sub, state):
                done = chunk.finished
                yield chunk
        finally:
            sub.close()
            self.router.release(d, cost)
            if decode_ref is not None:
                _forget(decode_ref)
            if not done:
                # D frees its blocks (and releases P's lease if the handle reached it, once its read
                # has ended); P stops a prefill still running. WRITE: D keeps blocks that a push
                # may still land in until P says its pushes have ended (``pushing``: a P was asked).
                # (sent outside this task's lineage: Serve cancels it, and Ray its calls, at a disconnect)
                push_to = _ref(d) if mode.reserve_first else None
                send(d.actor.abort, rid, None, bool(asked) or not mode.reserve_first)
                for p in asked:
                    if p.key not in state.dead:
                        send(p.actor.abort, rid, push_to)

    async def _prefill(
        self,
        req: GenRequest,
        state: FlowState,
        pick: Callable[[int], Member],
        call: Callable[[Member], Any],
        asked: list[Member],
    ) -> tuple[Handoff, Member]:
        """Run ``call(P)`` on ``pick(attempt)``; if P dies, once more on another (failure rule).
        Each P asked is appended to ``asked`` (the caller aborts them if the request ends early)."""
        for attempt in range(self.config.runtime.prefill_retries + 1):
            p = pick(attempt)
            state.prefill_key = p.key
            cost = len(req.prompt_token_ids)
            self.router.acquire(p, cost)
            asked.append(p)
            ref = call(p)
            try:
                result: Handoff = await deadline(ref, self.timeout_s, f"prefill on {p.key}")
                return result, p
            except ray.exceptions.RayActorError:
                self._dead(p, state)
                if attempt >= self.config.runtime.prefill_retries:
                    raise
                self.counters["prefill_retries"] += 1
                log.warning("prefill of %s: %s died, retrying on another P", req.request_id, p.key)
            except BaseException:
                # Cancelled or timed out: the flow's abort stops P's task, or frees the request's
                # blocks if the task had already finished.
                _forget(ref)
                raise
            finally:
                self.router.release(p, cost)
        raise AssertionError("unreachable")

    # -- shared ---------------------------------------------------------------------------------

    async def _call(self, worker: Member, ref: Any, what: str, state: FlowState) -> Any:
        try:
            return await deadline(ref, self.timeout_s, f"{what} on {worker.key}")
        except ray.exceptions.RayActorError:
            self._dead(worker, state)
            raise

    async def _stream(
        self, worker: Member, sub: Subscription, state: FlowState
    ) -> AsyncGenerator[TokenChunk, None]:
        """The request's chunks from ``worker``'s stream: every output that arrived, merged."""
        try:
            while True:
                items = await sub.next(self.timeout_s)
                chunk = _merge(items)
                if chunk.token_ids or chunk.finished:
                    yield chunk
                if chunk.finished:
                    return
        except ray.exceptions.RayActorError:
            self._dead(worker, state)
            raise

    def _dead(self, member: Member, state: FlowState) -> None:
        state.dead.add(member.key)
        self.coordinator.report_failure.remote(member.key, member.epoch)


def _merge(items: list[RequestOutput]) -> TokenChunk:
    """One chunk from consecutive outputs of a request; an error output raises its typed error."""
    if len(items) == 1:
        item = items[0]
        item.raise_error()
        return TokenChunk(
            item.token_ids, item.logprobs, item.finish_reason, item.top_logprobs, item.prompt_logprobs
        )
    chunk = TokenChunk([])
    for item in items:
        item.raise_error()
        chunk.token_ids.extend(item.token_ids)
        if item.logprobs is not None:
            chunk.logprobs = [*(chunk.logprobs or []), *item.logprobs]
        if item.top_logprobs is not None:
            chunk.top_logprobs = [*(chunk.top_logprobs or []), *item.top_logprobs]
        chunk.prompt_logprobs = chunk.prompt_logprobs or item.prompt_logprobs
        chunk.finish_reason = item.finish_reason
        if item.finished:
            break
    return chunk


def _ref(member: Member) -> PeerRef:
    return PeerRef(member.key, member.epoch)


def _lp(logprob: float | None) -> list[float] | None:
    return [logprob] if logprob is not None else None


def _forget(ref: Any) -> None:
    """Stop a worker's call we no longer wait for, without logging its (expected) error later."""
    ray.cancel(ref, recursive=False)
    with contextlib.suppress(Exception):
        ref.future().add_done_callback(lambda f: f.cancelled() or f.exception())
