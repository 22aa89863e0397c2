"""The batched sampler: greedy, temperature, top-k and top-p over a [B, vocab] logits tensor.

Random rows use the exponential-race form of sampling (argmax of probs / E, E ~ Exp(1)), with E
drawn from a counter-based hash of (row key, token id) computed in int64 tensor ops. The row key is
a pure function of (request seed, output position), so the noise, and with it the sampled token,
is the same on every engine and in every batch composition, on CPU and CUDA alike.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import torch

from moriio_ray.engine.device import upload

_M32 = 0xFFFF_FFFF
_M64 = 0xFFFF_FFFF_FFFF_FFFF
# Below this temperature a row is greedy: logits / 1e-30 in float32 overflow to inf, and the
# softmax of inf is NaN, so a tiny positive temperature must not reach the division.
MIN_TEMPERATURE = 1e-5


def _splitmix64(x: int) -> int:
    x = (x + 0x9E37_79B9_7F4A_7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58_476D_1CE4_E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D0_49BB_1331_11EB) & _M64
    return x ^ (x >> 31)


def row_key(seed: int, position: int) -> int:
    """The 64-bit noise key of output position ``position`` of a request seeded with ``seed``."""
    return _splitmix64(_splitmix64(seed & _M64) ^ position)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # x holds values in [0, 2**32); every product stays below 2**59, so int64 never overflows
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def _on(
    device: torch.device, values: list[int] | list[float] | list[bool], dtype: torch.dtype
) -> torch.Tensor:
    """A small host list as a device tensor, without a host synchronisation (see ``upload``)."""
    return upload(np.asarray(values, dtype=_NP[dtype]), device)


_NP = {torch.int64: np.int64, torch.float32: np.float32, torch.bool: np.bool_}


def uniform_noise(keys: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, vocab] float32 uniforms in (0, 1), a pure function of each row's key and the token id."""
    lo = _on(device, [k & _M32 for k in keys], torch.int64)[:, None]
    hi = _on(device, [k >> 32 for k in keys], torch.int64)[:, None]
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device)[None, :]
    x = _mix32((lo + ids * 0x9E3779B1) & _M32)
    x = _mix32(x ^ hi)
    return ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))


@dataclasses.dataclass(frozen=True)
class SamplingRow:
    """One row's settings (greedy when temperature is 0)."""

    temperature: float
    top_k: int  # <= 0: off
    top_p: float
    key: int  # row_key(seed, position)
    want_logprob: bool
    top_logprobs: int = 0  # alternatives to return beside the sampled token's log probability


def _filter(scaled: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask everything outside each row's top-k, then outside its top-p nucleus, to -inf."""
    vocab, device = scaled.shape[1], scaled.device
    top_k = _on(device, [min(r.top_k, vocab) if r.top_k > 0 else vocab for r in rows], torch.int64)
    top_p = _on(device, [r.top_p for r in rows], torch.float32)
    values, order = scaled.sort(dim=-1, descending=True, stable=True)  # [B, V]
    ranks = torch.arange(vocab, device=device)[None, :]
    values = values.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = values.softmax(dim=-1)
    # drop a token when the tokens ranked above it already hold top_p of the mass (keeps rank 0)
    values = values.masked_fill(probs.cumsum(dim=-1) - probs > top_p[:, None], float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, values)


class Sampled(NamedTuple):
    """One step's samples on the device: token ids [B] int64; when a row asks, the raw log
    probabilities [B] float32 of the sampled tokens and the ``k`` most likely tokens' ids [B, k]
    int64 and log probabilities [B, k] float32 (``k`` the largest ``top_logprobs`` of the rows)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def sample_device(logits: torch.Tensor, rows: list[SamplingRow], raw: torch.Tensor | None = None) -> Sampled:
    """Sample logits [B, V] float32 on the device, without a host sync. ``raw``: the logits before
    shaping (penalties, bias), which the log probabilities are taken from (default ``logits``)."""
    greedy = logits.argmax(dim=-1)  # [B]
    tokens = greedy
    device = logits.device
    if any(_random(r) for r in rows):
        temps = _on(device, [r.temperature if _random(r) else 1.0 for r in rows], torch.float32)
        scaled = logits / temps[:, None]
        if any(r.top_k > 0 or r.top_p < 1.0 for r in rows):
            scaled = _filter(scaled, rows)
        noise = -torch.log(uniform_noise([r.key for r in rows], logits.shape[1], device))  # Exp(1)
        sampled = (scaled.softmax(dim=-1) / noise).argmax(dim=-1)
        is_greedy = _on(device, [not _random(r) for r in rows], torch.bool)
        tokens = torch.where(is_greedy, greedy, sampled)
    if not any(r.want_logprob for r in rows):
        return Sampled(tokens)
    source = logits if raw is None else raw
    log_probs = source.log_softmax(dim=-1)  # [B, V]
    chosen = log_probs.gather(1, tokens[:, None]).squeeze(1)  # [B]
    k = max(r.top_logprobs for r in rows)
    if not k:
        return Sampled(tokens, chosen)
    top_values, top_ids = log_probs.topk(k, dim=-1)  # [B, k], sorted, most likely first
    return Sampled(tokens, chosen, top_ids, top_values)


def _random(row: SamplingRow) -> bool:
    return row.temperature >= MIN_TEMPERATURE


def sample_each_device(
    logits: torch.Tensor, rows: list[SamplingRow], raw: torch.Tensor | None = None
) -> tuple[Sampled, list[BaseException | None]]:
    """``sample_device``, isolating rows: if the batch fails, each row is sampled alone (a row's
    token does not depend on the batch), and only the rows that fail alone get an error (token -1)."""
    try:
        return sample_device(logits, rows, raw), [None] * len(rows)
    except Exception:
        pass
    raw = logits if raw is None else raw
    parts: list[Sampled] = []
    errors: list[BaseException | None] = []
    want = any(r.want_logprob for r in rows)
    k = max(r.top_logprobs for r in rows) if want else 0
    device = logits.device
    failed = Sampled(
        torch.full((1,), -1, dtype=torch.int64, device=device),
        torch.full((1,), float("nan"), device=device),
        torch.zeros((1, k), dtype=torch.int64, device=device),
        torch.full((1, k), float("nan"), device=device),
    )
    for i, row in enumerate(rows):
        error: BaseException | None = None
        # every row asks for what the batch asks for, so that the parts stack
        alone = dataclasses.replace(row, want_logprob=want, top_logprobs=k)
        try:
            part = sample_device(logits[i : i + 1], [alone], raw[i : i + 1])
        except Exception as exc:
            part, error = failed, exc
        parts.append(part)
        errors.append(error)

    def cat(name: str) -> torch.Tensor | None:
        return torch.cat([getattr(p, name) for p in parts]) if getattr(parts[0], name) is not None else None

    tokens = torch.cat([p.tokens for p in parts])
    return Sampled(tokens, cat("logprobs"), cat("top_ids"), cat("top_logprobs")), errors


def _on_host(rows: list[SamplingRow], sampled: Sampled) -> tuple[list[int], list[float | None]]:
    lps = sampled.logprobs.tolist() if sampled.logprobs is not None else [None] * len(rows)
    return sampled.tokens.tolist(), [lp if r.want_logprob else None for r, lp in zip(rows, lps, strict=True)]


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[float | None]]:
    """``sample_device``, read back: token ids and (where asked for) their log probabilities."""
    return _on_host(rows, sample_device(logits, rows))


def sample_each(
    logits: torch.Tensor, rows: list[SamplingRow]
) -> tuple[list[int], list[float | None], list[BaseException | None]]:
    """``sample_each_device``, read back."""
    sampled, errors = sample_each_device(logits, rows)
    return (*_on_host(rows, sampled), errors)
