"""Paged attention over a mixed batch: slot-mapped KV writes, then one attention call per layer.

A layer's cache is a pair of views ``k_cache``/``v_cache`` of shape [num_blocks, block_size,
kv_heads, head_dim]; in the block-major layout they are strided views, which every op here accepts.

The kernel interface (``AttnMetadata``'s first block of fields): a batch is B rows, each a sequence
that feeds ``q_len`` new tokens (packed back to back, ``cu_seqlens_q``) after ``context_len -
q_len`` cached ones; query token i of a row sees the row's keys at positions <= its own (causal,
aligned to the end of the context). The first ``num_decodes`` rows are decodes (q_len 1). New K/V
are in the cache before ``attend`` runs (``write_kv``: block ``slot_blocks[t]``, offset
``slot_offsets[t]``), so a kernel reads every key through ``block_tables``. That is the shape of a
varlen paged attention kernel (FlashAttention's ``flash_attn_varlen_func`` with a block table,
FlashInfer's batch prefill with a paged KV cache): one could replace ``attend`` and read only those
fields. The torch path here reads its own per-step precomputation (``decode_mask``,
``decode_tables``, ``prefill``), built once per step and shared by every layer.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from moriio_ray.engine.attention_prefill import (
    ExtendRow,
    PrefillPlan,
    additive,
    extend_attention,
    gather_blocks,
    prefill_attention,
)


@dataclasses.dataclass
class AttnMetadata:
    """Per-step tensors shared by every layer (built once per step by the runner or the graphs)."""

    slot_blocks: torch.Tensor  # [T] int64: the block each new token's K/V goes to
    slot_offsets: torch.Tensor  # [T] int64: its offset inside that block
    num_decodes: int = 0  # rows [0, num_decodes) feed one token each
    context_lens: torch.Tensor | None = None  # [B] int64: cached + new tokens of each row
    block_tables: torch.Tensor | None = None  # [B, W] int64 (entries past a row's blocks: padding)
    cu_seqlens_q: torch.Tensor | None = None  # [B + 1] int64: token offsets of the rows
    q_lens: list[int] = dataclasses.field(default_factory=list)  # host copies, per row
    start_pos: list[int] = dataclasses.field(default_factory=list)  # tokens cached before the step
    # the torch path's precomputation
    decode_tables: torch.Tensor | None = None  # [Bd, Wd] int64: the (batched) decode rows' tables
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, Wd * block_size]: bool (True = attend) or 0/-inf
    # decode rows far longer than the others attend alone (``split_decodes``): then the batched
    # rows are ``decode_batched`` [Bd] of the first num_decodes, and the others ``decode_alone``
    decode_batched: torch.Tensor | None = None
    decode_alone: list[ExtendRow] = dataclasses.field(default_factory=list)
    prefill: PrefillPlan | None = None  # the prefill rows (after the decodes)


def decode_mask(context_lens: torch.Tensor, num_slots: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, 1, 1, num_slots]: slot j of sequence b takes part iff j < context_lens[b] (bool, or with
    ``dtype`` an additive mask, which SDPA would otherwise rebuild from the bool one every layer)."""
    span = torch.arange(num_slots, device=context_lens.device)
    keep = (span[None, :] < context_lens[:, None])[:, None, None, :]
    return keep if dtype is None else additive(keep, dtype)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata
) -> None:
    """Scatter new K/V [T, kv_heads, head_dim] into their slots (one vectorised index_put each)."""
    k_cache[meta.slot_blocks, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, meta.slot_offsets] = v


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttnMetadata,
) -> torch.Tensor:
    """q [T, H, D] over each row's context -> [T, H, D]; k/v [T, Hkv, D] are the new tokens' K/V,
    already written into the cache (a fresh prompt attends over them without reading the cache)."""
    num_decodes = meta.num_decodes
    if num_decodes == q.shape[0]:
        return paged_decode_attention(q, k_cache, v_cache, meta)
    assert meta.prefill is not None
    if num_decodes == 0:
        return prefill_attention(q, k, v, k_cache, v_cache, meta.prefill)
    out = torch.empty_like(q)
    out[:num_decodes] = paged_decode_attention(q[:num_decodes], k_cache, v_cache, meta)
    nd = num_decodes
    out[nd:] = prefill_attention(q[nd:], k[nd:], v[nd:], k_cache, v_cache, meta.prefill)
    return out


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata
) -> torch.Tensor:
    """One query token per sequence against its cached context, through the block table.

    q [B, H, D] -> [B, H, D]. The cached blocks are gathered in one op per K and V (padded to the
    longest context; rows far longer than the others attend alone), and the query heads of one KV
    head are treated as that head's query rows, so GQA needs no repeat.
    """
    assert meta.decode_tables is not None and meta.decode_mask is not None
    if not meta.decode_alone:
        return _batched_decode(q, k_cache, v_cache, meta.decode_tables, meta.decode_mask)
    assert meta.decode_batched is not None
    out = torch.empty_like(q)
    if meta.decode_batched.numel():
        rows = meta.decode_batched
        out[rows] = _batched_decode(q[rows], k_cache, v_cache, meta.decode_tables, meta.decode_mask)
    for row in meta.decode_alone:
        out[row.start : row.end] = extend_attention(q[row.start : row.end], k_cache, v_cache, row)
    return out


def _batched_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k = gather_blocks(k_cache, tables).flatten(1, 2).transpose(1, 2)  # [B, Hkv, S, D]
    v = gather_blocks(v_cache, tables).flatten(1, 2).transpose(1, 2)  # [B, Hkv, S, D]
    qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    return out.reshape(num_seqs, num_heads, head_dim)
