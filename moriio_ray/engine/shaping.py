"""Logit shaping for one step, batched: repetition, frequency and presence penalties, logit bias
and min_tokens, applied to the sampling rows' logits [R, V] before temperature, top-k and top-p.

The host keeps each shaping sequence's distinct tokens and their counts across steps (folding in
one new token a step) and builds flat (row, token) index lists over the rows that shape at all; the
device applies them with a few ``index_add_`` / ``index_copy_`` calls on the flattened logits, so
the cost grows with the distinct tokens involved, never with rows x vocabulary, and a step without
any shaping row costs one pass over the rows' flags. A token still pending on the device
(overlapped scheduling) counts from the previous step's sampled tokens, without a host sync.

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

    rows: list[int] = dataclasses.field(default_factory=list)
    tokens: list[np.ndarray] = dataclasses.field(default_factory=list)
    values: list[np.ndarray] = dataclasses.field(default_factory=list)

    def add(self, row: int, tokens: np.ndarray, values: np.ndarray | None = None) -> None:
        self.rows.append(row)
        self.tokens.append(tokens)
        if values is not None:
            self.values.append(values)

    def keys(self, vocab: int, device: torch.device) -> torch.Tensor | None:
        """[N] int64 flat indices ``row * vocab + token`` on the device, or None when empty."""
        if not self.rows:
            return None
        lengths = [len(t) for t in self.tokens]
        rows = np.repeat(np.asarray(self.rows, dtype=np.int64), lengths)
        return upload(rows * vocab + np.concatenate(self.tokens), device)

    def vals(self, device: torch.device) -> torch.Tensor:
        return upload(np.concatenate(self.values), device)


class _Grow:
    """A growable numpy vector (capacity doubles); ``view`` is its filled part."""

    def __init__(self, dtype: type) -> None:
        self.data: np.ndarray = np.empty(16, dtype=dtype)
        self.size = 0

    def append(self, value: float) -> None:
        if self.size == len(self.data):
            self.data = np.concatenate([self.data, np.empty_like(self.data)])
        self.data[self.size] = value
        self.size += 1

    @property
    def view(self) -> np.ndarray:
        return self.data[: self.size]


class _Tokens:
    """A sequence's distinct tokens, kept across steps: each step folds in only the tokens that
    came since the last, so a step never rebuilds them from Python lists, and the device needs no
    de-duplication. ``out`` / ``counts``: the distinct output tokens and their counts; ``seen``: the
    distinct prompt and output tokens (repetition penalty)."""

    def __init__(self, seq: Sequence) -> None:
        self.out, self.counts, self.seen = _Grow(np.int64), _Grow(np.float32), _Grow(np.int64)
        self._out_at: dict[int, int] = {}
        self._seen: set[int] = set()
        self.num_outputs = 0
        # a continuation: its prompt ends with what it emitted before, which counts as output
        emitted = seq.prompt_ids[len(seq.prompt_ids) - seq.sample_offset :] if seq.sample_offset else []
        for token in seq.prompt_ids:
            self._see(token)
        for token in emitted:
            self._count(token)

    def _see(self, token: int) -> None:
        if token not in self._seen:
            self._seen.add(token)
            self.seen.append(token)

    def _count(self, token: int) -> None:
        at = self._out_at.get(token)
        if at is None:
            self._out_at[token] = self.out.size
            self.out.append(token)
            self.counts.append(1.0)
        else:
            self.counts.data[at] += 1.0

    def update(self, seq: Sequence) -> _Tokens:
        """Fold in the output tokens the host learnt since the last step."""
        for token in seq.output_ids[self.num_outputs :]:
            self._see(token)
            self._count(token)
        self.num_outputs = max(self.num_outputs, len(seq.output_ids))
        return self


_tokens: weakref.WeakKeyDictionary[Sequence, _Tokens] = weakref.WeakKeyDictionary()
_bias: weakref.WeakKeyDictionary[Sequence, tuple[np.ndarray, np.ndarray]] = weakref.WeakKeyDictionary()


def _bias_of(seq: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """A sequence's logit bias as (token ids, values) arrays, made once."""
    bias = _bias.get(seq)
    if bias is None:
        items = seq.params.logit_bias
        ids = np.fromiter(items.keys(), np.int64, len(items))
        bias = _bias[seq] = (ids, np.fromiter(items.values(), np.float32, len(items)))
    return bias


def _tokens_of(seq: Sequence) -> _Tokens:
    tokens = _tokens.get(seq)
    if tokens is None:
        tokens = _tokens[seq] = _Tokens(seq)
    return tokens.update(seq)


@dataclasses.dataclass
class ShapingPlan:
    """What one step applies; built before the forward pass (the rows' pending counts change after)."""

    repetition: _Flat  # each distinct prompt and output token of a row, value: its penalty
    output: _Flat  # each distinct output token known on the host, value: its count
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
            if p.repetition_penalty != 1.0:
                plan.repetition_by_row[i] = p.repetition_penalty
                plan.repetition.add(i, tokens.seen.view)
            if penalized and tokens.out.size:
                plan.output.add(i, tokens.out.view, tokens.counts.view)  # values: counts, for now
            plan.presence[i], plan.frequency[i] = p.presence_penalty, p.frequency_penalty
            if seq.num_pending:
                plan.pending_rows.append(i)
                plan.pending_src.append(seq.pending_row)
        if p.logit_bias:
            plan.bias.add(i, *_bias_of(seq))
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
    rep = plan.repetition.keys(vocab, device)  # distinct per row
    out = plan.output.keys(vocab, device)  # distinct per row
    if pending is not None:
        # a pending token is new to its row unless the host already has it (then it was counted)
        new_rep = pending if rep is None else pending[~torch.isin(pending, rep)]
        new_out = pending if out is None else pending[~torch.isin(pending, out)]
    if rep is not None:
        penalty = upload(np.asarray(plan.repetition_by_row, dtype=np.float32), device)  # [R]
        if pending is not None:
            rep = torch.cat([rep, new_rep])
        values = flat.index_select(0, rep)
        scale = penalty.index_select(0, rep // vocab)
        flat.index_copy_(0, rep, torch.where(values > 0, values / scale, values * scale))
    if out is not None:
        flat.index_add_(0, out, upload(_penalties(plan), device))
    if pending is not None:
        frequency = upload(np.asarray(plan.frequency, dtype=np.float32), device)  # [R]
        presence = upload(np.asarray(plan.presence, dtype=np.float32), device)  # [R]
        flat.index_add_(0, pending, -frequency.index_select(0, pending // vocab))
        flat.index_add_(0, new_out, -presence.index_select(0, new_out // vocab))
    bias = plan.bias.keys(vocab, device)
    if bias is not None:
        flat.index_add_(0, bias, plan.bias.vals(device))
    banned = plan.banned.keys(vocab, device)
    if banned is not None:
        flat.index_fill_(0, banned, float("-inf"))
    return logits


def _penalties(plan: ShapingPlan) -> np.ndarray:
    """[N] -(frequency x count + presence) per distinct output token of ``plan.output``, for all its
    rows in three vector operations (not a few small ones per row)."""
    lengths = [len(t) for t in plan.output.tokens]
    frequency = np.repeat(np.asarray(plan.frequency, dtype=np.float32)[plan.output.rows], lengths)
    presence = np.repeat(np.asarray(plan.presence, dtype=np.float32)[plan.output.rows], lengths)
    return -(np.concatenate(plan.output.values) * frequency + presence)


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
