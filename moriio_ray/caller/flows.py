"""The request flows, driven from the caller's side (a driver or the Serve ingress).

Each flow makes one Ray call per request; each worker forwards to the next.
Disaggregated (READ and WRITE, one function with numbered steps):
  1. pick D (READ: P first, then a D that can reach it) and subscribe to D's output stream;
  2. call P, naming D: P prefills (WRITE: after reserving D's blocks itself, pushing each layer)
     and hands its result to D in a call of its own; retried once on another P if P dies;
  3. the first token, sampled on P, comes back in P's reply (D never sends it again);
  4. D brings the KV in and decodes; its tokens come on the stream, the first of them with D's
     hand-over timings.
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

from moriio_ray.caller.router import Router
from moriio_ray.caller.streams import OutputStreams, Subscription
from moriio_ray.config import PipelineConfig
from moriio_ray.errors import PeerLost
from moriio_ray.protocol import wire
from moriio_ray.protocol.deadline import deadline
from moriio_ray.protocol.detached import send
from moriio_ray.protocol.messages import (
    GenRequest,
    Handoff,
    Member,
    PeerRef,
    PushResult,
    RequestOutput,
    Timings,
)

log = logging.getLogger(__name__)


@dataclass
class FlowState:
    """What one request's flow has produced so far (read by the pipeline for results and timings)."""

    emitted: list[int] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    prefill_key: str | None = None
    prefill_done_unix: float | None = None  # P's first token (the hand-over's timings start there)
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

    async def run(
        self, req: GenRequest, state: FlowState, streams: OutputStreams, chunk_tokens: int = 1
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's chunks; the first chunk holds the first token, each later one at
        least ``chunk_tokens`` tokens (or the rest of the request)."""
        budget = req.params.max_tokens
        attempt = req
        while True:
            try:
                if self.config.mode == "colocated":
                    gen = self._colocated(attempt, state, streams, chunk_tokens)
                else:
                    gen = self._disaggregated(attempt, state, streams, chunk_tokens)
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
        self, req: GenRequest, state: FlowState, streams: OutputStreams, chunk_tokens: int
    ) -> AsyncGenerator[RequestOutput, None]:
        c = self.router.pick("colocated", exclude=state.dead)
        state.decode_key = c.key
        cost = len(req.prompt_token_ids) + req.params.max_tokens
        self.router.acquire(c, cost)
        sub = streams.open(c, req.request_id)
        done = False
        try:
            ref = self._actor(c, state).generate.remote(wire.pack(req), streams.caller_id)
            out: RequestOutput = wire.unpack(await self._call(c, ref, "generate", state), RequestOutput)
            state.timings.cached_tokens = out.num_cached_tokens
            first = _merge([out])
            done = first.finished
            yield first
            if done:
                return
            async for chunk in self._stream(c, sub, state, chunk_tokens):
                done = chunk.finished  # set before each yield: the consumer may close us there
                yield chunk
        finally:
            sub.close()
            self.router.release(c, cost)
            if not done:
                _abort(c, req.request_id)

    # -- disaggregated --------------------------------------------------------------------------

    async def _disaggregated(
        self, req: GenRequest, state: FlowState, streams: OutputStreams, chunk_tokens: int
    ) -> AsyncGenerator[RequestOutput, None]:
        rid = req.request_id
        read = self.config.mode == "read"
        # 1. Pick D (READ: P first, then a D that can reach it) and subscribe to its stream.
        p0 = self.router.pick("prefill", exclude=state.dead) if read else None
        d = (
            self.router.pick_decode_for(p0, exclude=state.dead)
            if p0 is not None
            else self.router.pick("decode", exclude=state.dead)
        )
        state.decode_key = d.key
        cost = req.params.max_tokens + (0 if read else len(req.prompt_token_ids))
        self.router.acquire(d, cost)
        sub = streams.open(d, rid)
        asked: list[Member] = []  # every P asked to prefill it (WRITE: to push into D's blocks)
        done = False
        try:
            # 2. P prefills and hands its result to D (once more on another P if P dies).
            def pick(attempt: int) -> Member:
                if attempt == 0 and p0 is not None:
                    return p0
                return self.router.pick_prefill_for(d, exclude=state.dead)

            to, caller, packed = _ref(d), streams.caller_id, wire.pack(req)
            method = "prefill" if read else "prefill_push"  # WRITE: P reserves on D itself
            result, _p = await self._prefill(
                req, state, pick, lambda p: getattr(p.actor, method).remote(packed, to, caller), asked
            )
            state.timings.prefill_s = result.prefill_s
            state.timings.cached_tokens = result.num_cached_tokens
            state.prefill_done_unix = result.prefill_done_unix
            if isinstance(result, PushResult):  # WRITE: what P pushed (D's cached blocks excepted)
                state.timings.push_wait_s = result.push_wait_s
                state.timings.transfer_bytes = result.num_bytes
            # 3. The first token, from P's result.
            done = result.finish_reason is not None
            first_top = [result.first_top_logprobs] if result.first_top_logprobs is not None else None
            yield RequestOutput(
                rid,
                [result.first_token],
                _lp(result.first_logprob),
                result.finish_reason,
                top_logprobs=first_top,
                prompt_logprobs=result.prompt_logprobs,
            )
            if done:
                return
            # 4. D has the KV and decodes; its tokens follow on the stream.
            async for chunk in self._stream(d, sub, state, chunk_tokens):
                done = chunk.finished
                yield chunk
        finally:
            sub.close()
            self.router.release(d, cost)
            if not done:
                # D frees its blocks (a read still in flight keeps them, and P's lease, until it
                # ends); P stops a prefill still running. WRITE: D keeps blocks that a push may
                # still land in until P says its pushes have ended.
                # (sent outside this task's lineage: Serve cancels it, and Ray its calls, at a disconnect)
                _abort(d, rid)
                for p in asked:
                    if p.key not in state.dead:
                        _abort(p, rid, None if read else to)

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
            ref = None
            try:
                ref = call(p)  # (a P whose actor is gone raises here)
                result: Handoff = wire.unpack(
                    await deadline(ref, self.timeout_s, f"prefill on {p.key}"), Handoff
                )
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
                if ref is not None:
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
        self, worker: Member, sub: Subscription, state: FlowState, chunk_tokens: int
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's chunks from ``worker``'s stream: every output that arrived (at least
        ``chunk_tokens`` tokens of them, or the rest of the request), merged."""
        try:
            while True:
                items = await sub.next(self.timeout_s, chunk_tokens)
                if items[0].start is not None and state.prefill_done_unix is not None:
                    state.timings.add_handoff(state.prefill_done_unix, items[0].start)
                chunk = _merge(items)
                if chunk.token_ids or chunk.finished:
                    yield chunk
                if chunk.finished:
                    return
        except ray.exceptions.RayActorError:
            self._dead(worker, state)
            raise

    def _actor(self, member: Member, state: FlowState) -> Any:
        """``member``'s actor; one that is gone is dead, as a failed call to it would say."""
        try:
            return member.actor
        except ray.exceptions.RayActorError:
            self._dead(member, state)
            raise

    def _dead(self, member: Member, state: FlowState) -> None:
        state.dead.add(member.key)
        self.coordinator.report_failure.remote(member.key, member.epoch)


def _merge(items: list[RequestOutput]) -> RequestOutput:
    """One output from consecutive outputs of a request; an error output raises its typed error."""
    for item in items:
        item.raise_error()
        if item.finished:
            items = items[: items.index(item) + 1]
            break
    if len(items) == 1:
        return items[0]
    last = items[-1]
    merged = RequestOutput(last.request_id, [t for item in items for t in item.token_ids])
    if any(item.logprobs is not None for item in items):
        merged.logprobs = [v for item in items for v in item.logprobs or ()]
    if any(item.top_logprobs is not None for item in items):
        merged.top_logprobs = [v for item in items for v in item.top_logprobs or ()]
    merged.prompt_logprobs = next((i.prompt_logprobs for i in items if i.prompt_logprobs), None)
    merged.finish_reason = last.finish_reason
    return merged


def _ref(member: Member) -> PeerRef:
    return PeerRef(member.key, member.epoch)


def _lp(logprob: float | None) -> list[float] | None:
    return [logprob] if logprob is not None else None


def _abort(member: Member, *args: Any) -> None:
    """Abort a request on ``member``, outside the caller's task lineage (nothing to abort on a
    member whose actor is gone)."""
    with contextlib.suppress(ray.exceptions.RayActorError):
        send(member.actor.abort, *args)


def _forget(ref: Any) -> None:
    """Stop a worker's call we no longer wait for, without logging its (expected) error later."""
    ray.cancel(ref, recursive=False)
    with contextlib.suppress(Exception):
        ref.future().add_done_callback(lambda f: f.cancelled() or f.exception())
