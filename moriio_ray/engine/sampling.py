"""SamplingParams: how one request's tokens are chosen and when it stops.

A frozen msgspec Struct, so it pickles for Ray and decodes from JSON; an invalid value raises
InvalidRequest naming the field. Randomness is a pure function of (seed, output position), so a
request whose first token is sampled on a prefill engine and the rest on a decode engine gets
exactly the tokens one colocated engine gives for the same seed.

Bounds, all here: absolute caps that hold whatever the model (``__post_init__``), and the model's
own limits (``check_for_model``: top_k and stop token ids against its vocabulary), which the
pipeline and the engine check where the model is known.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from moriio_ray.errors import InvalidRequest

MAX_VOCAB_SIZE = 1 << 24  # no model's vocabulary is larger: the cap on top_k and on token ids
MAX_TOKENS_CAP = 1 << 24  # the cap on max_tokens before the model's length is known
MAX_TEMPERATURE = 1e4
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1  # a seed is any signed or unsigned 64-bit integer
MAX_STOP_STRINGS = 32
MAX_STOP_BYTES = 512  # per stop string, UTF-8; each step decodes a tail of about 4x this
MAX_STOP_TOKEN_IDS = 1024
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0  # a bias lies in [-100, 100], as OpenAI's
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's cap
MAX_FORMAT_BYTES = 1 << 16  # a response_format's JSON text


def _show(value: Any) -> str:
    """``repr(value)``, cut short: an error message never echoes a megabyte of input."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequest(f"{name}: {_show(value)} must be an integer in {low}..{high}")


def _float(name: str, value: Any, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{name}: {_show(value)} must be a number in {allowed}")
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        number = math.inf
    if not math.isfinite(number):
        raise InvalidRequest(f"{name}: {_show(value)} must be a finite number in {allowed}")
    return number


def _list(name: str, value: Any, max_len: int, what: str) -> None:
    if not isinstance(value, list):
        raise InvalidRequest(f"{name}: {_show(value)} must be a list of {what}")
    if len(value) > max_len:
        raise InvalidRequest(f"{name}: {len(value)} items; at most {max_len} {what} are allowed")


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Per-request sampling and stopping.

    ``temperature == 0`` is greedy. ``top_k`` of -1 (or 0) and ``top_p == 1`` turn those filters off.
    ``seed`` makes sampling reproducible (None: a fresh random seed per request). Generation stops
    at ``max_tokens``, at any of ``stop_token_ids``, at EOS unless ``ignore_eos``, or once the
    detokenized output contains a ``stop`` string. ``logprobs`` returns each sampled token's log
    probability under the model's unmodified distribution (log_softmax of the raw logits), and
    ``top_logprobs`` alternatives (the most likely tokens of that same distribution) beside it.

    Logit shaping, applied before temperature, top-k and top-p (the log probabilities stay raw):
    ``repetition_penalty`` divides a positive logit (multiplies a negative one) of every token in
    the prompt or the output; ``frequency_penalty`` subtracts the penalty times a token's count in
    the output, ``presence_penalty`` the penalty once for a token in the output; ``logit_bias`` adds
    its value to its token's logit; until ``min_tokens`` tokens are out, EOS and ``stop_token_ids``
    cannot be sampled.

    Bounds: ``max_tokens`` 1..2**24 (and within the model's length), ``temperature`` finite in
    [0, 10000], ``top_p`` finite in (0, 1], ``top_k`` -1, 0 or 1..2**24 (and at most the
    vocabulary), ``seed`` within 64 bits, at most 32 stop strings of at most 512 bytes, at most
    1024 stop token ids (each a token of the vocabulary), penalties in [-2, 2],
    ``repetition_penalty`` in (0, 10], at most 1024 ``logit_bias`` entries in [-100, 100],
    ``min_tokens`` at most ``max_tokens``, ``top_logprobs`` and ``prompt_logprobs`` 0..20.

    ``prompt_logprobs`` (vLLM's name): every prompt token's log probability given the tokens before
    it (None for the first) and that many alternatives, computed in the prefill and returned with
    the first output token (this reads the prefill's logits back at once: a device sync).
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
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    min_tokens: int = 0
    prompt_logprobs: int | None = None  # None: off; else the prompt tokens' logprobs and alternatives
    response_format: str | None = None  # structured output: the OpenAI response_format, as JSON text

    def __post_init__(self) -> None:
        _int("max_tokens", self.max_tokens, 1, MAX_TOKENS_CAP)
        temperature = _float("temperature", self.temperature, f"[0, {MAX_TEMPERATURE:g}] (0 = greedy)")
        if not 0.0 <= temperature <= MAX_TEMPERATURE:
            raise InvalidRequest(
                f"temperature: {_show(self.temperature)} must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy)"
            )
        if not 0.0 < _float("top_p", self.top_p, "(0, 1]") <= 1.0:
            raise InvalidRequest(f"top_p: {_show(self.top_p)} must be in (0, 1]")
        if self.top_k not in (-1, 0) or isinstance(self.top_k, bool):
            _int("top_k", self.top_k, 1, MAX_VOCAB_SIZE)
        if self.seed is not None:
            _int("seed", self.seed, MIN_SEED, MAX_SEED)
        _list("stop", self.stop, MAX_STOP_STRINGS, "non-empty strings")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise InvalidRequest(f"stop[{i}]: {_show(s)} must be a non-empty string")
            if len(s.encode("utf-8", "surrogatepass")) > MAX_STOP_BYTES:
                raise InvalidRequest(f"stop[{i}]: longer than {MAX_STOP_BYTES} bytes; shorten it")
        _list("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS, "token ids")
        for i, token_id in enumerate(self.stop_token_ids):
            _int(f"stop_token_ids[{i}]", token_id, 0, MAX_VOCAB_SIZE - 1)
        for name in ("ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{name}: {_show(getattr(self, name))} must be true or false")
        _int("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        for name in ("presence_penalty", "frequency_penalty"):
            if abs(_float(name, getattr(self, name), "[-2, 2]")) > MAX_PENALTY:
                raise InvalidRequest(f"{name}: {_show(getattr(self, name))} must be in [-2, 2]")
        rep = _float("repetition_penalty", self.repetition_penalty, "(0, 10]")
        if not 0.0 < rep <= MAX_REPETITION_PENALTY:
            raise InvalidRequest(f"repetition_penalty: {_show(self.repetition_penalty)} must be in (0, 10]")
        self._check_logit_bias()
        _int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.response_format is not None and (
            not isinstance(self.response_format, str) or len(self.response_format) > MAX_FORMAT_BYTES
        ):
            raise InvalidRequest(f"response_format: must be JSON text of at most {MAX_FORMAT_BYTES} bytes")

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise InvalidRequest(f"logit_bias: {_show(self.logit_bias)} must map token ids to numbers")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidRequest(
                f"logit_bias: {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS_TOKENS} are allowed"
            )
        for token_id, bias in self.logit_bias.items():
            _int("logit_bias", token_id, 0, MAX_VOCAB_SIZE - 1)
            if abs(_float(f"logit_bias[{token_id}]", bias, "[-100, 100]")) > MAX_LOGIT_BIAS:
                raise InvalidRequest(f"logit_bias[{token_id}]: {_show(bias)} must be in [-100, 100]")

    @property
    def shapes_logits(self) -> bool:
        """Whether any logit shaping (penalties, bias, min_tokens) applies to this request."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.response_format is not None
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_for_model(self, vocab_size: int) -> None:
        """The model's own bounds: ``top_k``, ``stop_token_ids`` and ``logit_bias`` within its vocabulary (the
        pipeline checks ``max_tokens`` against the model's length, with the prompt's)."""
        if self.top_k > vocab_size:
            raise InvalidRequest(
                f"top_k: {self.top_k} must be at most the vocabulary size {vocab_size} (-1: off)"
            )
        for i, token_id in enumerate(self.stop_token_ids):
            if token_id >= vocab_size:
                raise InvalidRequest(
                    f"stop_token_ids[{i}]: {token_id} is not a token id of this model (0..{vocab_size - 1})"
                )
        for token_id in self.logit_bias:
            if token_id >= vocab_size:
                raise InvalidRequest(
                    f"logit_bias: {token_id} is not a token id of this model (0..{vocab_size - 1})"
                )
