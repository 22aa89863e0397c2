"""What ``Engine.step`` returns: msgspec Structs, so they pickle for Ray and encode to msgpack."""

from __future__ import annotations

import msgspec


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """A prompt's tokens' log probabilities (None for the first: nothing precedes it) and, per
    token, its alternatives (token id, log probability), most likely first (empty for the first)."""

    logprobs: list[float | None]
    top: list[list[tuple[int, float]]]


class PrefillResult(msgspec.Struct, frozen=True, kw_only=True):
    """A prefill engine's handle on a finished prompt: which blocks hold its KV, and for how long.

    The blocks stay leased under ``transfer_id == request_id`` until ``Engine.release`` or until the
    lease deadline plus the engine's grace period has passed. A first token that already ended the
    request leases nothing (``block_ids`` is empty).
    """

    block_ids: list[int]
    num_tokens: int  # prompt tokens whose K/V the blocks hold
    first_token: int
    lease_deadline_unix: float  # wall-clock time.time(): it travels to other processes
    first_logprob: float | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache, not computed
    first_top_logprobs: list[tuple[int, float]] | None = None  # the first token's alternatives
    prompt_logprobs: PromptLogprobs | None = None


class StepOutput(msgspec.Struct, kw_only=True):
    """New tokens of one request from one step.

    ``finish_reason`` is "stop" (EOS, a stop token or string) or "length" (max_tokens or
    max_model_len). On a prefill engine every request finishes after its first token with
    ``prefill`` set; ``finish_reason`` is then None unless the whole request is already complete.
    ``error`` (a typed error's class name and message) ends a request that failed in the engine;
    the engine has freed its blocks and serves the others on.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    # per new token, its alternatives: (token id, raw log probability), most likely first
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with a request's first token, if it asked
    prefill: PrefillResult | None = None
    error: tuple[str, str] | None = None
    num_cached_tokens: int = 0  # on a request's first output: prompt tokens found in the prefix cache
