"""What an engine checks before it takes a request, the Sequence it makes of it, and the typed
error that ends one request whose own sampling or stop checks raised (fault isolation: the engine
serves the others on)."""

from __future__ import annotations

import secrets

from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.engine.sequence import Sequence, blocks_for
from moriio_ray.errors import CapacityError, InvalidRequest, MoriioRayError, RequestFailed


def check_request(
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    *,
    in_use: bool,
    vocab_size: int,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    prefill_only: bool,
) -> None:
    """InvalidRequest or CapacityError, naming the field, for a request this engine cannot take."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequest(f"params: expected SamplingParams, got {type(params).__name__}")
    if not request_id or in_use:
        raise InvalidRequest(f"request_id: {request_id!r} is empty or already in use; use a unique id")
    if not prompt:
        raise InvalidRequest("prompt_token_ids: the prompt is empty; send at least one token")
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt):
        raise InvalidRequest(f"prompt_token_ids: every id must be an integer in 0..{vocab_size - 1}")
    params.check_for_model(vocab_size)
    if len(prompt) >= max_model_len:
        raise CapacityError(
            f"prompt of {len(prompt)} tokens leaves no room to generate within max_model_len "
            f"{max_model_len}; shorten it"
        )
    # the last sampled token is never fed back, so at most total - 1 tokens are ever cached
    total = min(len(prompt) + params.max_tokens, max_model_len)
    cached = len(prompt) if prefill_only else total - 1
    need = blocks_for(cached, block_size)
    if need > num_blocks:
        raise CapacityError(
            f"{cached} tokens need {need} KV blocks of {block_size} tokens; this engine has "
            f"{num_blocks}; shorten the prompt or max_tokens"
        )


def new_sequence(
    request_id: str, prompt: list[int], params: SamplingParams, sample_offset: int, *, prefill_only: bool
) -> Sequence:
    """A checked request as a Sequence. The caller's make_request draws the seed of a sampled
    request (P and D must share it); only an engine driven directly draws one here, and greedy
    decoding needs none."""
    seed = params.seed if params.seed is not None else (secrets.randbits(63) if params.temperature > 0 else 0)
    seq = Sequence(request_id, list(prompt), params, seed, prefill_only=prefill_only)
    seq.sample_offset = sample_offset
    return seq


def request_error(request_id: str, exc: BaseException) -> MoriioRayError:
    """The typed error that ends a request whose own sampling or stop checks raised ``exc``."""
    if isinstance(exc, MoriioRayError):
        return exc
    return RequestFailed(
        f"request {request_id} failed in the engine ({type(exc).__name__} in its sampling or "
        "stop checks); the engine serves the other requests on"
    )
