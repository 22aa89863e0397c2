"""Sequence: one request's tokens, blocks and progress inside the engine."""

from __future__ import annotations

import dataclasses
import enum

from moriio_ray.engine.sampling import SamplingParams


class SeqState(enum.Enum):
    WAITING = "waiting"  # needs a prefill (new, recomputing after preemption, or reserved + recompute)
    RUNNING = "running"  # its KV is cached up to the last token; decodes one token per step
    RESERVED = "reserved"  # decode role: holds blocks while its prompt KV is transferred in
    FINISHED = "finished"


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


@dataclasses.dataclass(eq=False)
class Sequence:
    """A request as the scheduler sees it.

    Invariant while RUNNING: ``num_cached == num_tokens - 1``: every token but the last has its
    K/V in the cache, and the next step feeds the last one.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the request's seed, or a random one drawn at admission
    prefill_only: bool = False  # prefill role: finish after the first token and lease the blocks
    lease_s: float | None = None  # prefill role: this request's lease length (None: the engine's)
    sample_offset: int = 0  # output positions sampled before this request (a continuation)
    state: SeqState = SeqState.WAITING
    output_ids: list[int] = dataclasses.field(default_factory=list)
    block_table: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids
