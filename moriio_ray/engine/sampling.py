"""SamplingParams: how one request's tokens are chosen and when it stops.

A frozen msgspec Struct, so it pickles for Ray and decodes from JSON; an invalid value raises
InvalidRequest naming the field. Randomness is a pure function of (seed, output position), so a
request whose first token is sampled on a prefill engine and the rest on a decode engine gets
exactly the tokens one colocated engine gives for the same seed.
"""

from __future__ import annotations

from typing import Any

import msgspec

from moriio_ray.errors import InvalidRequest


def _int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidRequest(f"{name}: {value!r} must be an integer >= {low}")


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Per-request sampling and stopping.

    ``temperature == 0`` is greedy. ``top_k`` of -1 (or 0) and ``top_p == 1`` turn those filters off.
    ``seed`` makes sampling reproducible (None: a fresh random seed per request). Generation stops
    at ``max_tokens``, at any of ``stop_token_ids``, at EOS unless ``ignore_eos``, or once the
    detokenized output contains a ``stop`` string. ``logprobs`` returns each sampled token's log
    probability under the model's unmodified distribution (log_softmax of the raw logits).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        _int("max_tokens", self.max_tokens, 1)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise InvalidRequest(f"temperature: {self.temperature!r} must be a number >= 0")
        if not 0.0 <= float(self.temperature) <= 1e4:
            raise InvalidRequest(f"temperature: {self.temperature!r} must be in [0, 10000] (0 = greedy)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise InvalidRequest(f"top_p: {self.top_p!r} must be a number in (0, 1]")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise InvalidRequest(f"top_p: {self.top_p!r} must be in (0, 1]")
        if self.top_k not in (-1, 0):
            _int("top_k", self.top_k, 1)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequest(f"seed: {self.seed!r} must be an integer or null")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest(f"stop: {self.stop!r} must be a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list):
            raise InvalidRequest(f"stop_token_ids: {self.stop_token_ids!r} must be a list of token ids")
        for token_id in self.stop_token_ids:
            _int("stop_token_ids[]", token_id, 0)
        for name in ("ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{name}: {getattr(self, name)!r} must be true or false")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
