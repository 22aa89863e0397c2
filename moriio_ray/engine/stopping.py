"""Stop conditions, checked after every appended token, and the final text with a stop string cut."""

from __future__ import annotations

from moriio_ray.engine.sequence import Sequence
from moriio_ray.engine.tokenizer import Tokenizer


def check_stop(seq: Sequence, tokenizer: Tokenizer, max_model_len: int) -> str | None:
    """ "stop", "length" or None for a sequence whose last output token was just appended."""
    params, last = seq.params, seq.output_ids[-1]
    if last in params.stop_token_ids:
        return "stop"
    if not params.ignore_eos and last in tokenizer.eos_token_ids:
        return "stop"
    if params.stop and _tail_has_stop(seq.output_ids, params.stop, tokenizer):
        return "stop"
    if len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def _tail_has_stop(output_ids: list[int], stop: list[str], tokenizer: Tokenizer) -> bool:
    # A stop string that ends in the newest token lies inside the text of the last few tokens (a
    # token yields at least a byte of text; a character is at most 4 bytes), so decoding that tail
    # each step finds it without re-decoding the whole output.
    window = 4 * max(len(s.encode()) for s in stop) + 8
    text = tokenizer.decode(output_ids[-window:])
    return any(s in text for s in stop)
