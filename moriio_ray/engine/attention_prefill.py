"""The torch path's attention for the prefill rows of a step: fresh prompts and continued chunks.

Rows that start at position 0 and come last in the batch (fresh prompts, or first chunks) attend
causally over their own new tokens, without reading the cache: one SDPA call when their lengths
are equal, a padded and masked call for mixed lengths, or one call per row when the mask would be
large. Every other row continues a cached prefix (a later chunk of a long prompt): its context is
gathered from the cache through its block table, and its queries see the keys at positions up to
their own (one SDPA call per such row; a step holds few of them).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

# Above this many mask elements mixed-length fresh prompts run one SDPA call each instead.
MAX_PREFILL_MASK_ELEMS = 1 << 24


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, ...] rows ``tables`` [...] -> [*tables.shape, ...] (``index_select``: on the
    CPU about 3x faster than indexing, which copies element by element)."""
    return cache.index_select(0, tables.flatten()).view(*tables.shape, *cache.shape[1:])


def additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool attention mask (True = attend) as 0 / -inf in ``dtype``: built once per step, where
    SDPA would convert a bool mask in every layer."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


@dataclasses.dataclass
class ExtendRow:
    """A row whose new tokens [start, end) of the prefill part follow cached ones."""

    start: int
    end: int
    blocks: torch.Tensor  # [nb] int64: the blocks of its context
    context_len: int
    mask: torch.Tensor | None  # [q_len, context_len] additive: query i sees key j iff j <= its
    # position (None: every key; a decode row)


@dataclasses.dataclass
class FreshRows:
    """Rows from token ``start`` to the end, each starting at position 0: causal over their own tokens."""

    start: int
    seq_lens: list[int]
    pad_index: torch.Tensor | None = None  # [T] int64: row of each token in a padded [B * max_len] batch
    mask: torch.Tensor | None = None  # [B, 1, max_len, max_len] additive (0 = attend)

    @property
    def max_len(self) -> int:
        return max(self.seq_lens)

    @property
    def uniform(self) -> bool:
        """All rows have the same length (one causal SDPA call, no mask)."""
        return len(set(self.seq_lens)) == 1


@dataclasses.dataclass
class PrefillPlan:
    extend: list[ExtendRow]
    fresh: FreshRows | None


def fresh_rows(start: int, seq_lens: list[int], lens: torch.Tensor, dtype: torch.dtype) -> FreshRows:
    """The plan of fresh rows of ``seq_lens`` tokens (``lens``: the same, [B] int64 on the device),
    with the padding index and mask (in ``dtype``) when they differ, built on the device."""
    rows = FreshRows(start, list(seq_lens))
    num_rows, max_len, total = len(seq_lens), rows.max_len, sum(seq_lens)
    if not rows.uniform and num_rows * max_len * max_len <= MAX_PREFILL_MASK_ELEMS:
        device = lens.device
        row_of = torch.repeat_interleave(torch.arange(num_rows, device=device), lens, output_size=total)
        first = torch.cumsum(lens, 0) - lens  # [B] each row's first token
        rows.pad_index = row_of * max_len + torch.arange(total, device=device) - first[row_of]  # [T]
        ar = torch.arange(max_len, device=device)
        causal = ar[None, :] <= ar[:, None]  # [L, L]: query i sees keys j <= i
        keep = causal[None] & (ar[None, None, :] < lens[:, None, None])  # [B, L, L]
        rows.mask = additive(keep[:, None], dtype)  # [B, 1, L, L]
    return rows


# The cost of a row's own attention call, in blocks of padded batch work (a rough CPU figure)
WIDE_ROW_BLOCKS = 16


def split_decodes(widths: list[int], max_wide: int = 8) -> list[int]:
    """The decode rows (of ``widths`` blocks of context each) that attend alone: padding every row
    to the longest context costs rows x longest, so a few rows far longer than the others (a long
    prompt now decoding) are cheaper one by one. Empty when padding is cheapest."""
    order = sorted(range(len(widths)), key=lambda i: -widths[i])
    best, best_k, alone = len(widths) * widths[order[0]], 0, 0
    for k in range(1, min(max_wide, len(widths) - 1) + 1):
        alone += widths[order[k - 1]] + WIDE_ROW_BLOCKS
        cost = (len(widths) - k) * widths[order[k]] + alone
        if cost < best:
            best, best_k = cost, k
    return sorted(order[:best_k])


def prefill_plan(
    q_lens: list[int],
    start_pos: list[int],
    lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    dtype: torch.dtype,
) -> PrefillPlan:
    """The plan of the prefill rows: ``q_lens`` and ``start_pos`` per row (host), ``lens`` the
    q_lens on the device [rows], ``block_tables`` [rows, W]; masks in the model's ``dtype``."""
    device = block_tables.device
    num_fresh = 0
    while num_fresh < len(q_lens) and start_pos[len(q_lens) - 1 - num_fresh] == 0:
        num_fresh += 1
    first_fresh = len(q_lens) - num_fresh
    extend, token = [], 0
    for row in range(first_fresh):
        n, start = q_lens[row], start_pos[row]
        context = start + n
        keys = torch.arange(context, device=device)
        queries = torch.arange(start, context, device=device)
        nb = -(-context // block_size)
        mask = additive(keys[None, :] <= queries[:, None], dtype)  # [n, context]
        extend.append(ExtendRow(token, token + n, block_tables[row, :nb], context, mask))
        token += n
    fresh = fresh_rows(token, q_lens[first_fresh:], lens[first_fresh:], dtype) if num_fresh else None
    return PrefillPlan(extend, fresh)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
) -> torch.Tensor:
    """q [T, H, D] of the prefill rows (k/v [T, Hkv, D] their new K/V) -> [T, H, D]."""
    if not plan.extend:
        assert plan.fresh is not None
        return fresh_attention(q, k, v, plan.fresh)
    out = torch.empty_like(q)
    for row in plan.extend:
        out[row.start : row.end] = extend_attention(q[row.start : row.end], k_cache, v_cache, row)
    if plan.fresh is not None:
        f = plan.fresh.start
        out[f:] = fresh_attention(q[f:], k[f:], v[f:], plan.fresh)
    return out


def extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row: ExtendRow
) -> torch.Tensor:
    """q [n, H, D] of one row over its cached context (its new K/V included) -> [n, H, D]."""
    k = gather_blocks(k_cache, row.blocks).flatten(0, 1)[: row.context_len]  # [S, Hkv, D]
    v = gather_blocks(v_cache, row.blocks).flatten(0, 1)[: row.context_len]  # [S, Hkv, D]
    qb, kb, vb = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, heads, len, D]
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=row.mask, enable_gqa=True)
    return out[0].transpose(0, 1)


def fresh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: FreshRows) -> torch.Tensor:
    """Causal attention of each packed row over its own new tokens.

    q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]. Equal lengths run as one causal SDPA call; mixed
    lengths are padded to the longest and masked when the mask is small, else they run one causal
    SDPA call per row.
    """
    num_seqs, max_len = len(rows.seq_lens), rows.max_len
    if rows.uniform:
        return _causal(q.view(num_seqs, max_len, *q.shape[1:]), k, v).reshape(q.shape)
    if rows.mask is None:
        outs, start = [], 0
        for n in rows.seq_lens:
            outs.append(_causal(q[None, start : start + n], k[start : start + n], v[start : start + n]))
            start += n
        return torch.cat(outs, dim=1).reshape(q.shape)
    assert rows.pad_index is not None
    padded = []
    for x in (q, k, v):
        buf = x.new_zeros(num_seqs * max_len, *x.shape[1:])
        buf[rows.pad_index] = x
        padded.append(buf.view(num_seqs, max_len, *x.shape[1:]).transpose(1, 2))  # [B, H, L, D]
    qp, kp, vp = padded
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=rows.mask, enable_gqa=True)
    return out.transpose(1, 2).reshape(num_seqs * max_len, *q.shape[1:])[rows.pad_index]


def _causal(qb: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # qb [B, L, H, D] with k/v packed as [B * L, Hkv, D] -> [B, L, H, D]
    kb, vb = (x.view(qb.shape[0], qb.shape[1], *x.shape[1:]) for x in (k, v))
    qb, kb, vb = (x.transpose(1, 2) for x in (qb, kb, vb))
    out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2)
