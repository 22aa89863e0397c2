"""Logit shaping for one step, batched: repetition, frequency and presence penalties, logit bias
and min_tokens, applied to the sampling rows' logits [R, V] before temperature, top-k and top-p.

The host builds flat (row, token) index lists over the rows that shape at all; the device applies
them with a few ``index_add_`` / ``index_put_`` calls on the flattened logits, so the cost grows
with the tokens involved, never with rows x vocabulary, and a step without any shaping row costs
one pass over the rows' flags. A token still pending on the device (overlapped scheduling) counts
from the previous step's sampled tokens, without a host sync.

A request's output tokens are those it sampled (``output_ids`` and the pending one) plus, for a
continuation after a worker death, the last ``sample_offset`` tokens of its prompt (what it had
emitted before).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from moriio_ray.engine.device import upload
from moriio_ray.engine.sequence import Sequence


@dataclasses.dataclass
class _Flat:
    """Flat (row, token[, value]) lists built on the host."""

    rows: list[np.ndarray] = dataclasses.field(default_factory=list)
    tokens: list[np.ndarray] = dataclasses.field(default_factory=list)
    values: list[np.ndarray] = dataclasses.field(default_factory=list)

    def add(self, row: int, tokens: np.ndarray, value: float | np.ndarray = 0.0) -> None:
        self.rows.append(np.full(len(tokens), row, dtype=np.int64))
        self.tokens.append(tokens)
        self.values.append(np.broadcast_to(np.asarray(value, dtype=np.float32), (len(tokens),)))

    def keys(self, vocab: int, device: torch.device) -> torch.Tensor | None:
        """[N] int64 flat indices ``row * vocab + token`` on the device, or None when empty."""
        if not self.rows:
            return None
        keys = np.concatenate(self.rows) * vocab + np.concatenate(self.tokens)
        return upload(keys, device)

    def vals(self, device: torch.device) -> torch.Tensor:
        return upload(np.concatenate(self.values).astype(np.float32), device)


@dataclasses.dataclass
class ShapingPlan:
    """What one step applies; built before the forward pass (the rows' pending counts change after)."""

    repetition: _Flat  # every prompt and output token of a row, value: its penalty
    output: _Flat  # every output token (with repeats) known on the host, value: frequency penalty
    presence: list[float]  # per row (0 where the row has none)
    frequency: list[float]  # per row
    pending_rows: list[int]  # rows whose newest output token is still on the device ...
    pending_src: list[int]  # ... at this index of the previous step's sampled tokens
    bias: _Flat
    banned: _Flat  # EOS and stop ids of rows short of min_tokens


def plan_shaping(seqs: list[Sequence], eos_ids: list[int] | tuple[int, ...]) -> ShapingPlan | None:
    """The shaping of a step whose sampling rows are ``seqs``, or None when no row shapes."""
    if not any(s.params.shapes_logits for s in seqs):
        return None
    plan = ShapingPlan(_Flat(), _Flat(), [0.0] * len(seqs), [0.0] * len(seqs), [], [], _Flat(), _Flat())
    for i, seq in enumerate(seqs):
        p = seq.params
        if not p.shapes_logits:
            continue
        penalized = p.presence_penalty or p.frequency_penalty
        if penalized or p.repetition_penalty != 1.0:
            prompt = np.asarray(seq.prompt_ids, dtype=np.int64)
            out = np.asarray(seq.output_ids, dtype=np.int64)
            if seq.sample_offset:  # a continuation: its prompt ends with what it emitted before
                out = np.concatenate([prompt[len(prompt) - seq.sample_offset :], out])
            if p.repetition_penalty != 1.0:
                plan.repetition.add(i, np.concatenate([prompt, out]), p.repetition_penalty)
            if penalized:
                plan.output.add(i, out, p.frequency_penalty)
                plan.presence[i], plan.frequency[i] = p.presence_penalty, p.frequency_penalty
            if seq.num_pending and (penalized or p.repetition_penalty != 1.0):
                plan.pending_rows.append(i)
                plan.pending_src.append(seq.pending_row)
        if p.logit_bias:
            plan.bias.add(
                i,
                np.fromiter(p.logit_bias.keys(), np.int64, len(p.logit_bias)),
                np.fromiter(p.logit_bias.values(), np.float32, len(p.logit_bias)),
            )
        if p.min_tokens and len(seq.output_ids) + seq.num_pending < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
            if banned:
                plan.banned.add(i, np.asarray(banned, dtype=np.int64))
    return plan


@torch.inference_mode()  # the runner's logits are inference tensors
def apply_shaping(logits: torch.Tensor, plan: ShapingPlan, prev_tokens: torch.Tensor | None) -> torch.Tensor:
    """Shape ``logits`` [R, V] (float32, contiguous) in place per ``plan``; returns it."""
    rows, vocab = logits.shape
    device = logits.device
    flat = logits.view(-1)  # [R * V]
    pending = _pending_keys(plan, vocab, device, prev_tokens)
    rep = plan.repetition.keys(vocab, device)
    if rep is not None:
        penalty = torch.ones(rows, device=device)
        penalty[upload(np.concatenate(plan.repetition.rows), device)] = plan.repetition.vals(device)
        if pending is not None:
            rep = torch.cat([rep, pending])
        keys = torch.unique(rep)  # each (row, token) once: the penalty is not additive
        values = flat[keys]
        scale = penalty[keys // vocab]
        flat[keys] = torch.where(values > 0, values / scale, values * scale)
    out = plan.output.keys(vocab, device)
    if out is not None or pending is not None:
        frequency = upload(np.asarray(plan.frequency, dtype=np.float32), device)  # [R]
        presence = upload(np.asarray(plan.presence, dtype=np.float32), device)  # [R]
        parts = [k for k in (out, pending) if k is not None]
        keys = torch.cat(parts) if len(parts) > 1 else parts[0]
        flat.index_add_(0, keys, -frequency[keys // vocab])  # once per occurrence
        seen = torch.unique(keys)
        flat.index_add_(0, seen, -presence[seen // vocab])  # once per distinct token
    bias = plan.bias.keys(vocab, device)
    if bias is not None:
        flat.index_add_(0, bias, plan.bias.vals(device))
    banned = plan.banned.keys(vocab, device)
    if banned is not None:
        flat.index_fill_(0, banned, float("-inf"))
    return logits


def _pending_keys(
    plan: ShapingPlan, vocab: int, device: torch.device, prev_tokens: torch.Tensor | None
) -> torch.Tensor | None:
    """[P] flat keys of the tokens still on the device, or None."""
    if not plan.pending_rows:
        return None
    assert prev_tokens is not None  # a pending token exists only while its step's tokens do
    src = upload(np.asarray(plan.pending_src, dtype=np.int64), device)
    rows = upload(np.asarray(plan.pending_rows, dtype=np.int64), device)
    return rows * vocab + prev_tokens[src].to(torch.int64)
