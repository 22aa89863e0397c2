"""PDPipeline: the Python API over a running pool.

    pipe = PDPipeline.launch("configs/tiny_1p1d_cpu.yaml")      # or a PipelineConfig / dict
    result = pipe.generate("Hello", SamplingParams(max_tokens=16))
    async for event in pipe.stream("Hello", SamplingParams(max_tokens=16)): ...
    other = PDPipeline.connect("default")                        # from another driver, or Serve
    pipe.stats(); pipe.shutdown()

``generate`` and ``stats`` have async twins (``generate_async``, ``stats_async``) for code that
already runs an event loop (Serve); the sync forms run on a private loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import ray

from moriio_ray import env, metrics
from moriio_ray.caller.bgloop import BackgroundLoop
from moriio_ray.caller.detok import IncrementalText
from moriio_ray.caller.flows import Flows, FlowState
from moriio_ray.caller.results import GenerationResult, StreamEvent
from moriio_ray.caller.router import Router
from moriio_ray.caller.streams import OutputStreams
from moriio_ray.caller.validate import check_request
from moriio_ray.config import PipelineConfig
from moriio_ray.config_load import load_config, parse_pipeline_config
from moriio_ray.coordinator import actor as coord
from moriio_ray.engine.sampling import MAX_TOKENS_CAP, SamplingParams
from moriio_ray.engine.tokenizer import load_tokenizer
from moriio_ray.errors import ConfigError, InvalidRequest
from moriio_ray.protocol.deadline import deadline
from moriio_ray.protocol.membership import MembershipWatch
from moriio_ray.protocol.messages import GenRequest, Membership, Timings

log = logging.getLogger(__name__)


class PDPipeline:
    """A handle on a pipeline's coordinator plus a local router. Cheap to create; many may exist."""

    def __init__(self, coordinator: Any, config: PipelineConfig) -> None:
        self.coordinator = coordinator
        self.config = config
        logging.getLogger("moriio_ray").setLevel(env.log_level())
        self.router = Router()
        self.flows = Flows(config, self.router, coordinator)
        self.tokenizer = load_tokenizer(config.model)
        self.max_model_len = 0  # from the workers (0: not known yet)
        self.vocab_size = 0  # the model's, from the workers (0: not known yet)
        self._bg: BackgroundLoop | None = None
        self.watch = MembershipWatch(
            coordinator, self.router, config.runtime.remote_timeout_s, self._learn_model
        )
        # one set of output streams per event loop (their pumps and queues belong to it)
        self._streams: dict[asyncio.AbstractEventLoop, OutputStreams] = {}

    # -- creation -------------------------------------------------------------------------------

    @classmethod
    def launch(
        cls, config: PipelineConfig | dict[str, Any] | str | Path, *, detached: bool = False
    ) -> PDPipeline:
        """Start (or join) the pipeline named ``config.name`` and wait until every worker is ready."""
        cfg = _as_config(config)
        _ensure_ray()
        actor = coord.get_or_create(cfg, detached=detached)
        running: PipelineConfig = ray.get(actor.get_config.remote(), timeout=cfg.runtime.remote_timeout_s)
        if running != cfg:
            raise ConfigError(
                f"name: a pipeline named {cfg.name!r} already runs with another config; shut it down "
                "or choose another name"
            )
        # the coordinator bounds each worker's start by worker_start_timeout_s; this bounds the whole
        ray.get(
            actor.start.remote(), timeout=cfg.runtime.worker_start_timeout_s + cfg.runtime.remote_timeout_s
        )
        pipe = cls(actor, cfg)
        pipe._sync(pipe._refresh())
        return pipe

    @classmethod
    def connect(cls, name: str = "default", *, timeout_s: float = 60.0) -> PDPipeline:
        """Attach to a running pipeline (another driver, or the Serve ingress)."""
        _ensure_ray()
        try:
            actor = coord.get_existing(name)
        except ValueError:
            raise ConfigError(f"name: no pipeline named {name!r} is running in this Ray cluster") from None
        cfg: PipelineConfig = ray.get(actor.get_config.remote(), timeout=timeout_s)
        ray.get(actor.start.remote(), timeout=timeout_s)
        pipe = cls(actor, cfg)
        pipe._sync(pipe._refresh())
        return pipe

    # -- membership -----------------------------------------------------------------------------

    async def _refresh(self, timeout_s: float = 0.0) -> None:
        await self.watch.refresh(timeout_s)

    async def _learn_model(self, _answer: Membership) -> None:
        """The model's length and vocabulary, from the first worker's descriptors (once)."""
        membership = self.router.membership
        if self.max_model_len or not membership.members:
            return
        info = membership.members[0].info
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size

    # -- requests -------------------------------------------------------------------------------

    def make_request(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> GenRequest:
        """Tokenize and validate a request (InvalidRequest / CapacityError for bad input).

        Every bound that depends on the model is checked here, for the Python API and the HTTP
        front end alike: token ids and ``top_k`` within the vocabulary, prompt plus ``max_tokens``
        within the model's length (``SamplingParams`` holds the absolute bounds)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params: expected SamplingParams, got {type(params).__name__}")
        if params.seed is None and params.temperature > 0:
            # P samples the first token and D the rest: both must draw from the same seed.
            params = msgspec.structs.replace(params, seed=secrets.randbits(63))
        if (prompt is None) == (token_ids is None):
            raise InvalidRequest("give exactly one of prompt and token_ids")
        ids = self._encode(prompt) if token_ids is None else _token_ids(token_ids)
        vocab = min(self.tokenizer.vocab_size, self.vocab_size or self.tokenizer.vocab_size)
        check_request(ids, params, vocab_size=vocab, max_model_len=self.max_model_len)
        return GenRequest(request_id=request_id or uuid.uuid4().hex, prompt_token_ids=ids, params=params)

    def _encode(self, prompt: object) -> list[int]:
        try:
            return self.tokenizer.encode(str(prompt))
        except Exception as exc:  # e.g. a string the tokenizer's encoding cannot represent
            raise InvalidRequest(f"prompt: it cannot be tokenized ({type(exc).__name__})") from None

    async def stream(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        chunk_tokens: int = 1,
    ) -> AsyncIterator[StreamEvent]:
        """Stream a request's text and tokens. Closing the iterator cancels the request everywhere.
        ``chunk_tokens``: each event after the first carries at least this many tokens (or the
        rest): a consumer that wants tokens k at a time wakes once per k, not once per step."""
        req = self.make_request(prompt, token_ids=token_ids, params=params, request_id=request_id)
        async for event in self.stream_request(req, chunk_tokens):
            yield event

    async def stream_request(self, req: GenRequest, chunk_tokens: int = 1) -> AsyncIterator[StreamEvent]:
        """Stream a request made by ``make_request`` (``chunk_tokens``: as ``stream``'s); closing
        the iterator cancels it everywhere."""
        if chunk_tokens < 1:
            raise InvalidRequest(f"chunk_tokens: {chunk_tokens} must be >= 1")
        # A caller that attached long ago and served nothing since (a new Serve replica) would
        # route on the membership of its connect, maybe to a worker replaced meanwhile.
        if self.watch.ensure() or self.router.membership.version < 0:
            await self._refresh()
        state = FlowState()
        text = IncrementalText(self.tokenizer, req.params.stop)
        t0 = time.perf_counter()
        mode = self.config.mode
        n_out = 0
        # aclosing: closing this stream closes the flow at once (the workers abort the request).
        flow = self.flows.run(req, state, self._output_streams(), chunk_tokens)
        async with contextlib.aclosing(flow) as chunks:
            async for chunk in chunks:
                now = time.perf_counter()
                if n_out == 0:
                    state.timings.ttft_s = now - t0
                    metrics.record_ttft(now - t0, mode=mode)
                n_out += len(chunk.token_ids)
                delta = text.add(chunk.token_ids, final=chunk.finished)
                reason = "stop" if text.stopped and not chunk.finished else chunk.finish_reason
                finished = reason is not None
                if finished:
                    state.timings.total_s = now - t0
                    if n_out > 1 and state.timings.ttft_s is not None:
                        metrics.record_tpot((now - t0 - state.timings.ttft_s) / (n_out - 1), mode=mode)
                    if state.timings.handoff_s is not None:
                        metrics.record_handoff(
                            state.timings.handoff_s, backend=self.config.transfer.backend, mode=mode
                        )
                yield StreamEvent(
                    request_id=req.request_id,
                    token_ids=chunk.token_ids,
                    text=delta,
                    finished=finished,
                    finish_reason=reason,
                    logprobs=chunk.logprobs,
                    top_logprobs=chunk.top_logprobs,
                    prompt_logprobs=chunk.prompt_logprobs,
                    num_prompt_tokens=len(req.prompt_token_ids),
                    num_output_tokens=n_out,
                    num_cached_tokens=state.timings.cached_tokens or 0,
                    timings=state.timings if finished else None,
                    prefill_worker=state.prefill_key,
                    decode_worker=state.decode_key,
                )
                if finished:
                    return

    def _output_streams(self) -> OutputStreams:
        loop = asyncio.get_running_loop()
        streams = self._streams.get(loop)
        if streams is None:
            for old in [lp for lp in self._streams if lp.is_closed()]:
                del self._streams[old]
            streams = self._streams[loop] = OutputStreams()
        return streams

    async def generate_async(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> GenerationResult:
        req = self.make_request(prompt, token_ids=token_ids, params=params, request_id=request_id)
        ids: list[int] = []
        logprobs: list[float] | None = None
        text: list[str] = []
        last: StreamEvent | None = None
        async for event in self.stream_request(req, chunk_tokens=req.params.max_tokens):  # one wake
            ids.extend(event.token_ids)
            text.append(event.text)
            if event.logprobs is not None:
                logprobs = (logprobs or []) + event.logprobs
            last = event
        assert last is not None and last.finished
        return GenerationResult(
            request_id=req.request_id,
            text="".join(text),
            token_ids=ids,
            finish_reason=last.finish_reason,
            num_prompt_tokens=len(req.prompt_token_ids),
            logprobs=logprobs,
            num_cached_tokens=last.num_cached_tokens,
            timings=last.timings or Timings(),
            prefill_worker=last.prefill_worker,
            decode_worker=last.decode_worker,
        )

    def generate(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> GenerationResult:
        """Run one request to completion (blocking)."""
        return self._sync(
            self.generate_async(prompt, token_ids=token_ids, params=params, request_id=request_id)
        )

    async def generate_batch_async(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | None = None,
        *,
        max_concurrency: int = 16,
    ) -> list[GenerationResult]:
        """Run many requests, at most ``max_concurrency`` at a time; results in input order."""
        gate = asyncio.Semaphore(max_concurrency)

        async def one(p: str | list[int]) -> GenerationResult:
            async with gate:
                if isinstance(p, str):
                    return await self.generate_async(p, params=params)
                return await self.generate_async(token_ids=p, params=params)

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    def generate_batch(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | None = None,
        *,
        max_concurrency: int = 16,
    ) -> list[GenerationResult]:
        """Blocking form of ``generate_batch_async``."""
        return self._sync(self.generate_batch_async(prompts, params, max_concurrency=max_concurrency))

    # -- management -----------------------------------------------------------------------------

    async def stats_async(self) -> dict[str, Any]:
        stats: dict[str, Any] = await deadline(
            self.coordinator.stats.remote(),
            coord.WORKER_STATS_TIMEOUT_S + self.config.runtime.remote_timeout_s,
            "the coordinator's stats",
        )
        stats["router"] = {"outstanding": dict(self.router.outstanding), "served": dict(self.router.served)}
        stats["flows"] = dict(self.flows.counters)
        return stats

    def stats(self) -> dict[str, Any]:
        """Per-worker engine counters (free/used/leased blocks, requests, transfers) and deaths."""
        return self._sync(self.stats_async())

    def shutdown(self) -> None:
        """Stop every worker and the coordinator."""
        self.watch.stop()
        for loop, streams in self._streams.items():
            if not loop.is_closed():
                loop.call_soon_threadsafe(streams.close)
        try:
            ray.get(self.coordinator.shutdown.remote(), timeout=60)
        finally:
            ray.kill(self.coordinator, no_restart=True)
            if self._bg is not None:
                self._bg.stop()

    def _sync(self, coro: Any) -> Any:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            coro.close()
            raise RuntimeError("this is the blocking API; inside an event loop use the *_async methods")
        if self._bg is None:
            self._bg = BackgroundLoop()
        return self._bg.run(coro)


def _as_config(config: PipelineConfig | dict[str, Any] | str | Path) -> PipelineConfig:
    if isinstance(config, PipelineConfig):
        return config
    if isinstance(config, dict):
        return parse_pipeline_config(config)
    return load_config(config)


def _token_ids(token_ids: object) -> list[int]:
    """A token-id prompt as a list of ints (InvalidRequest for anything else, or one too long)."""
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
        raise InvalidRequest(f"token_ids: expected a list of token ids, got {type(token_ids).__name__}")
    if len(token_ids) > MAX_TOKENS_CAP:
        raise InvalidRequest(f"token_ids: {len(token_ids)} ids; at most {MAX_TOKENS_CAP} are allowed")
    try:
        return [_token_id(t) for t in token_ids]  # type: ignore[attr-defined]
    except TypeError:
        raise InvalidRequest("token_ids: every token id must be an integer") from None


def _token_id(value: object) -> int:
    if isinstance(value, bool):
        raise TypeError("a bool is not a token id")
    return operator.index(value)  # type: ignore[arg-type]  # ints and numpy ints; floats raise


def _ensure_ray() -> None:
    if not ray.is_initialized():
        ray.init(namespace=coord.NAMESPACE, log_to_driver=True)
