"""What ``PDPipeline`` hands back: stream events and finished results."""

from __future__ import annotations

import msgspec

from moriio_ray.engine.outputs import PromptLogprobs
from moriio_ray.protocol.messages import Timings


class StreamEvent(msgspec.Struct, kw_only=True):
    """One piece of a streamed request."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (id, logprob), best first
    prompt_logprobs: PromptLogprobs | None = None  # on the first event, when the request asked
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (known from the first event)
    timings: Timings | None = None  # on the last event
    prefill_worker: str | None = None
    decode_worker: str | None = None


class GenerationResult(msgspec.Struct, kw_only=True):
    """A finished request."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    logprobs: list[float] | None = None
    num_cached_tokens: int = 0  # of the prompt, found in the prefix cache
    timings: Timings = msgspec.field(default_factory=Timings)
    prefill_worker: str | None = None
    decode_worker: str | None = None
