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
import weakref

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
        if not isinstance(value, np.ndarray):
            value = np.full(len(tokens), value, dtype=np.float32)
        self.values.append(value)

    def keys(self, vocab: int, device: torch.device) -> torch.Tensor | None:
        """[N] int64 flat indices ``row * vocab + token`` on the device, or None when empty."""
        if not self.rows:
            return None
        keys = np.concatenate(self.rows) * vocab + np.concatenate(self.tokens)
        return upload(keys, device)

    def vals(self, device: torch.device) -> torch.Tensor:
        return upload(np.concatenate(self.values), device)


class _Tokens:
    """A sequence's prompt and output tokens as arrays, kept across steps: each step appends only
    the tokens that came since the last (a step must not rebuild them from Python lists)."""

    def __init__(self, seq: Sequence) -> None:
        prompt = np.asarray(seq.prompt_ids, dtype=np.int64)
        self.prompt = prompt
        # a continuation: its prompt ends with what it emitted before, which counts as output
        self.head = prompt[len(prompt) - seq.sample_offset :] if seq.sample_offset else prompt[:0]
        self.out = np.empty(64, dtype=np.int64)
        self.num_out = 0

    def outputs(self, seq: Sequence) -> np.ndarray:
        """[len(head) + len(output_ids)] the sequence's output tokens."""
        ids = seq.output_ids
        if len(ids) < self.num_out:  # never expected (outputs only grow); start over
            self.num_out = 0
        if len(ids) > len(self.out):
            grown = np.empty(2 * len(ids), dtype=np.int64)
            grown[: self.num_out] = self.out[: self.num_out]
            self.out = grown
        if len(ids) > self.num_out:
            self.out[self.num_out : len(ids)] = ids[self.num_out :]
            self.num_out = len(ids)
        out = self.out[: self.num_out]
        return np.concatenate([self.head, out]) if len(self.head) else out


_tokens: weakref.WeakKeyDictionary[Sequence, _Tokens] = weakref.WeakKeyDictionary()


def _tokens_of(seq: Sequence) -> _Tokens:
    tokens = _tokens.get(seq)
    if tokens is None:
        tokens = _tokens[seq] = _Tokens(seq)
    return tokens


@dataclasses.dataclass
class ShapingPlan:
    """What one step applies; built before the forward pass (the rows' pending counts change after)."""

    repetition: _Flat  # every prompt and output token of a row, value: its penalty
    output: _Flat  # every output token (with repeats) known on the host, value: frequency penalty
    repetition_by_row: list[float]  # per row (1 where the row has none)
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
    n = len(seqs)
    plan = ShapingPlan(_Flat(), _Flat(), [1.0] * n, [0.0] * n, [0.0] * n, [], [], _Flat(), _Flat())
    for i, seq in enumerate(seqs):
        p = seq.params
        if not p.shapes_logits:
            continue
        penalized = p.presence_penalty or p.frequency_penalty
        if penalized or p.repetition_penalty != 1.0:
            tokens = _tokens_of(seq)
            out = tokens.outputs(seq)
            if p.repetition_penalty != 1.0:
                plan.repetition_by_row[i] = p.repetition_penalty
                plan.repetition.add(i, tokens.prompt, p.repetition_penalty)
                plan.repetition.add(i, out, p.repetition_penalty)
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
    vocab = logits.shape[1]
    device = logits.device
    flat = logits.view(-1)  # [R * V]
    pending = _pending_keys(plan, vocab, device, prev_tokens)
    rep = plan.repetition.keys(vocab, device)
    if rep is not None:
        penalty = upload(np.asarray(plan.repetition_by_row, dtype=np.float32), device)  # [R]
        if pending is not None:
            rep = torch.cat([rep, pending])
        keys = torch.unique(rep)  # each (row, token) once: the penalty is not additive
        values = flat.index_select(0, keys)
        scale = penalty.index_select(0, keys // vocab)
        flat.index_copy_(0, keys, torch.where(values > 0, values / scale, values * scale))
    out = plan.output.keys(vocab, device)
    if out is not None or pending is not None:
        frequency = upload(np.asarray(plan.frequency, dtype=np.float32), device)  # [R]
        presence = upload(np.asarray(plan.presence, dtype=np.float32), device)  # [R]
        parts = [k for k in (out, pending) if k is not None]
        keys = torch.cat(parts) if len(parts) > 1 else parts[0]
        flat.index_add_(0, keys, -frequency.index_select(0, keys // vocab))  # once per occurrence
        seen = torch.unique(keys)
        flat.index_add_(0, seen, -presence.index_select(0, seen // vocab))  # once per distinct token
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
