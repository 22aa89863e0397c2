"""Shared pieces of the failure-rule tests: streams run to their end with what happened to each,
workers by key, and the reference tokens (with log probabilities) of the engine in this process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from moriio_ray import PDPipeline, SamplingParams
from tests.integration.helpers import varied_prompts, wait_until
from tests.integration.reference import engine_outputs


@dataclass
class Outcome:
    """One request's stream: its tokens, the decode workers that served it, how and when it ended."""

    tokens: list[int] = field(default_factory=list)
    decode: set[str] = field(default_factory=set)
    error: BaseException | None = None
    ended_s: float = 0.0


async def _consume(pipe: PDPipeline, rid: str, ids: list[int], params: SamplingParams, out: Outcome) -> None:
    try:
        async for ev in pipe.stream(token_ids=ids, params=params, request_id=rid):
            out.tokens.extend(ev.token_ids)
            if ev.decode_worker is not None:
                out.decode.add(ev.decode_worker)
    except Exception as exc:
        out.error = exc
    out.ended_s = time.monotonic()


async def run_streams(
    pipe: PDPipeline,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    min_tokens: int,
    action: Callable[[], Awaitable[Any]],
    timeout_s: float = 120.0,
) -> tuple[list[Outcome], float]:
    """Stream every prompt; once each has ``min_tokens``, await ``action()``; wait for every
    stream to end. (the outcomes, the monotonic time the action started)"""
    outs = [Outcome() for _ in prompts]
    tag = time.monotonic_ns()
    tasks = [
        asyncio.ensure_future(_consume(pipe, f"r{tag}-{i}", ids, params, out))
        for i, (ids, out) in enumerate(zip(prompts, outs, strict=True))
    ]
    deadline_s = time.monotonic() + 60
    while not all(len(o.tokens) >= min_tokens or o.ended_s for o in outs):
        assert time.monotonic() < deadline_s, "the streams did not start"
        await asyncio.sleep(0.01)
    acted_s = time.monotonic()
    await action()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
    return outs, acted_s


def actor(pipe: PDPipeline, key: str) -> Any:
    member = ray.get(pipe.coordinator.lookup.remote(key), timeout=30)
    assert member is not None, f"{key} is not a live member"
    return member.actor


def epoch(pipe: PDPipeline, key: str) -> int:
    member = ray.get(pipe.coordinator.lookup.remote(key), timeout=30)
    return 0 if member is None else int(member.epoch)


def wait_replaced(pipe: PDPipeline, key: str, old_epoch: int, timeout_s: float = 120.0) -> None:
    """The coordinator runs a new epoch of ``key``, and this caller's router routes to it."""
    wait_until(lambda: epoch(pipe, key) > old_epoch, timeout_s, f"a replacement of {key}", poll_s=0.1)

    def routed() -> bool:
        member = pipe.router.membership.find(key)
        return member is not None and member.epoch > old_epoch

    wait_until(routed, 30, f"the router to route to the new {key}", poll_s=0.1)


def deaths(pipe: PDPipeline) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = ray.get(pipe.coordinator.stats.remote(), timeout=60)["deaths"]
    return found


def one_request(seed: int, max_tokens: int) -> tuple[list[int], SamplingParams, list[int]]:
    """A prompt, greedy params that run to ``max_tokens``, and the tokens they give."""
    prompt = varied_prompts(6, seed=seed)[5]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return prompt, params, reference([prompt], params)[0][0]


def reference(
    prompts: list[list[int]], params: SamplingParams
) -> tuple[list[list[int]], list[list[float] | None]]:
    """Colocated tokens (and log probabilities) of the tiny preset, from the engine in this process."""
    return engine_outputs(prompts, params)
