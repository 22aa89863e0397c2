"""Colocated reference tokens from the real engine in this process (no Ray), prefix cache off."""

from __future__ import annotations

import functools
import itertools

from moriio_ray.config import EngineConfig, ModelConfig
from moriio_ray.engine.engine import Engine
from moriio_ray.engine.sampling import SamplingParams
from tests.integration.helpers import BLOCK_SIZE, NUM_BLOCKS

_RUNS = itertools.count()


@functools.cache
def _engine() -> Engine:
    """One engine for the process (building one takes about half a second): between runs every
    request has ended, and with the prefix cache off nothing of a run stays."""
    return Engine(
        ModelConfig(preset="tiny", seed=0),
        # the prefix cache off: every pipeline (cache on by default) is held against an uncached run
        EngineConfig(device="cpu", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, enable_prefix_caching=False),
        role="colocated",
    )


def engine_outputs(
    prompts: list[list[int]], params: SamplingParams
) -> tuple[list[list[int]], list[list[float] | None]]:
    """Each prompt's tokens and (with ``params.logprobs``) log probabilities, all run as one batch."""
    engine = _engine()
    if engine.has_work():  # an earlier run was interrupted (a test's timeout): start afresh
        _engine.cache_clear()
        engine = _engine()
    keys = [f"ref{next(_RUNS)}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {k: [] for k in keys}
    logprobs: dict[str, list[float] | None] = {k: None for k in keys}
    for key, ids in zip(keys, prompts, strict=True):
        engine.add_request(key, ids, params)
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.logprobs is not None:
                logprobs[out.request_id] = [*(logprobs[out.request_id] or []), *out.logprobs]
    return [tokens[k] for k in keys], [logprobs[k] for k in keys]


def colocated_tokens(prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return engine_outputs(prompts, params)[0]


def truncate_at_stop(text: str, stop: list[str]) -> str:
    """``text`` up to (not including) the earliest occurrence of any stop string (what a reply
    with stop strings must hold)."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]
