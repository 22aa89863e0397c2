"""Sequence: one request's tokens, blocks and progress inside the engine."""

from __future__ import annotations

import dataclasses
import enum

from moriio_ray.engine.sampling import SamplingParams


class SeqState(enum.Enum):
    WAITING = "waiting"  # needs a prefill (new, recomputing after preemption, or reserved + recompute)
    RUNNING = "running"  # holds its blocks; prefills chunk by chunk, then decodes one token per step
    RESERVED = "reserved"  # decode role: holds blocks while its prompt KV is transferred in
    FINISHED = "finished"


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


@dataclasses.dataclass(eq=False)
class Sequence:
    """A request as the scheduler sees it.

    ``num_cached`` tokens have their K/V in the cache (it advances when a step is launched). While
    RUNNING, a sequence with ``num_cached < num_ahead - 1`` is still prefilling (each step feeds its
    next chunk), and so is one whose last prompt token is not cached yet (a chunk that stopped one
    token short: that token goes in a prefill chunk, which the layer hook sees, not as a decode);
    then ``num_cached == num_ahead - 1``: every token but the last is cached, and the next step
    feeds the last one. Under overlapped scheduling the newest ``num_pending`` tokens were
    sampled on the device and are not in ``output_ids`` yet: a step feeds the newest one straight
    from the device (row ``pending_row`` of the previous step's sampled tokens).
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
    num_pending: int = 0
    pending_row: int = -1
    # bumped when the sequence is preempted: rows of a step launched before then are discarded
    generation: int = 0
    # prefix caching: the keys of its full blocks of known tokens so far (token-based, so they
    # survive a preemption), how many of ``block_table`` are registered (or were hits), and the
    # prompt tokens its first admission found cached (what its reply reports as cached)
    block_keys: list[bytes] = dataclasses.field(default_factory=list)
    num_registered: int = 0
    num_hit_tokens: int = 0
    admitted: bool = False
    # params.prompt_logprobs: (logprob, alternatives) per prompt token, filled chunk by chunk
    prompt_logprobs: list[tuple[float | None, list[tuple[int, float]]]] | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens the host knows."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_ahead(self) -> int:
        """Every token, with those still on the device."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_cached < self.num_ahead - 1 or self.num_cached < len(self.prompt_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, count: int) -> list[int]:
        """Known tokens ``[start, start + count)`` (the chunk a prefill step feeds)."""
        num_prompt = len(self.prompt_ids)
        if start + count <= num_prompt:
            return self.prompt_ids[start : start + count]
        head = self.prompt_ids[start:] if start < num_prompt else []
        return head + self.output_ids[max(0, start - num_prompt) : start + count - num_prompt]

    def ends_ahead(self, max_model_len: int) -> bool:
        """Whether the tokens sampled so far (pending ones included) end the request by length, so
        that no further step may feed it (content stops, like EOS, show only once read back)."""
        num_out = len(self.output_ids) + self.num_pending
        if self.prefill_only:
            return num_out >= 1
        return num_out >= self.params.max_tokens or self.num_ahead >= max_model_len
