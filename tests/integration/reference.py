"""Colocated reference tokens from the real engine in this process (no Ray), prefix cache off."""

from __future__ import annotations

from moriio_ray.config import EngineConfig, ModelConfig
from moriio_ray.engine.engine import Engine
from moriio_ray.engine.sampling import SamplingParams
from tests.integration.helpers import BLOCK_SIZE, NUM_BLOCKS


def colocated_tokens(prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    engine = Engine(
        ModelConfig(preset="tiny", seed=0),
        # the prefix cache off: every pipeline (cache on by default) is held against an uncached run
        EngineConfig(device="cpu", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, enable_prefix_caching=False),
        role="colocated",
    )
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    while engine.has_work():
        for step in engine.step():
            out[step.request_id].extend(step.new_token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def truncate_at_stop(text: str, stop: list[str]) -> str:
    """``text`` up to (not including) the earliest occurrence of any stop string (what a reply
    with stop strings must hold)."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]
