"""The one check of a request against the model, for both front ends (``PDPipeline.make_request``
runs it; the HTTP ingress only parses, tokenizes and maps its errors to 400s).

Messages start with the field they concern (``prompt:``, ``max_tokens:``), which the ingress maps to
the OpenAI request's own field names. A prompt that leaves no room for one output token, or a
``max_tokens`` that does not fit after it, is a CapacityError (``context_length_exceeded`` over
HTTP); bad token ids are an InvalidRequest. Absolute bounds live in ``SamplingParams``; the engine
keeps its own check at the worker's boundary (``engine/admission.py``).
"""

from __future__ import annotations

from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.errors import CapacityError, InvalidRequest


def check_request(ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int) -> None:
    """InvalidRequest or CapacityError, naming the field, for a request this model cannot take.
    ``max_model_len`` 0: not known yet (the length rule is left to the engine)."""
    if not ids:
        raise InvalidRequest("prompt: the prompt is empty")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"prompt: token id {bad} is outside the vocabulary 0..{vocab_size - 1}")
    params.check_for_model(vocab_size)
    if not max_model_len:
        return
    room = max_model_len - len(ids)
    if room < 1:
        raise CapacityError(
            f"prompt: the prompt is {len(ids)} tokens but the model's context length is {max_model_len} "
            "tokens, leaving no room for output; shorten the prompt"
        )
    if params.max_tokens > room:
        raise CapacityError(
            f"max_tokens: the model's context length is {max_model_len} tokens, but the request asks "
            f"for {len(ids) + params.max_tokens} ({len(ids)} in the prompt, {params.max_tokens} to "
            f"generate); lower max_tokens to at most {room} or shorten the prompt"
        )
