"""Paged attention in torch: slot-mapped KV writes, varlen causal prefill, paged decode.

A layer's cache is a pair of views ``k_cache``/``v_cache`` of shape [num_blocks, block_size,
kv_heads, head_dim]; in the block-major layout they are strided views, which every op here accepts.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class AttnMetadata:
    """Per-step tensors shared by every layer (built once per step by the runner)."""

    is_prefill: bool
    slot_blocks: torch.Tensor  # [T] int64: the block each new token's K/V goes to
    slot_offsets: torch.Tensor  # [T] int64: its offset inside that block
    # prefill: B sequences packed back to back, seq_lens[b] new tokens each, all starting at position 0
    seq_lens: list[int] = dataclasses.field(default_factory=list)
    pad_index: torch.Tensor | None = None  # [T] int64: row of each token in a padded [B * max_len] batch
    prefill_mask: torch.Tensor | None = None  # [B, 1, max_len, max_len] bool, True = attend
    # decode: one new token per sequence
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int64 (padding entries are masked)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size] bool, True = attend

    @property
    def max_len(self) -> int:
        return max(self.seq_lens) if self.seq_lens else 0

    @property
    def uniform(self) -> bool:
        """All prefill sequences have the same length (one causal SDPA call, no mask)."""
        return len(set(self.seq_lens)) == 1


def decode_mask(context_lens: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[B, 1, 1, num_slots] bool: slot j of sequence b takes part iff j < context_lens[b]."""
    span = torch.arange(num_slots, device=context_lens.device)
    return (span[None, :] < context_lens[:, None])[:, None, None, :]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata
) -> None:
    """Scatter new K/V [T, kv_heads, head_dim] into their slots (one vectorised index_put each)."""
    k_cache[meta.slot_blocks, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, meta.slot_offsets] = v


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
    """Causal attention of each packed sequence over its own new tokens.

    q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]. Equal lengths run as one causal SDPA call; mixed
    lengths are padded to the longest and masked when the mask is small (``prefill_mask``), else
    they run one causal SDPA call per sequence.
    """
    num_seqs, max_len = len(meta.seq_lens), meta.max_len
    if meta.uniform:
        return _causal(q.view(num_seqs, max_len, *q.shape[1:]), k, v).reshape(q.shape)
    if meta.prefill_mask is None:
        outs, start = [], 0
        for n in meta.seq_lens:
            outs.append(_causal(q[None, start : start + n], k[start : start + n], v[start : start + n]))
            start += n
        return torch.cat(outs, dim=1).reshape(q.shape)
    assert meta.pad_index is not None
    padded = []
    for x in (q, k, v):
        buf = x.new_zeros(num_seqs * max_len, *x.shape[1:])
        buf[meta.pad_index] = x
        padded.append(buf.view(num_seqs, max_len, *x.shape[1:]).transpose(1, 2))  # [B, H, L, D]
    qp, kp, vp = padded
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.prefill_mask, enable_gqa=True)
    return out.transpose(1, 2).reshape(num_seqs * max_len, *q.shape[1:])[meta.pad_index]


def _causal(qb: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # qb [B, L, H, D] with k/v packed as [B * L, Hkv, D] -> [B, L, H, D]
    kb, vb = (x.view(qb.shape[0], qb.shape[1], *x.shape[1:]) for x in (k, v))
    qb, kb, vb = (x.transpose(1, 2) for x in (qb, kb, vb))
    out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2)


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata
) -> torch.Tensor:
    """One query token per sequence against its cached context, through the block table.

    q [B, H, D] -> [B, H, D]. The cached blocks are gathered in one indexing op per K and V, and the
    query heads of one KV head are treated as that head's query rows, so GQA needs no repeat.
    """
    assert meta.block_tables is not None and meta.decode_mask is not None
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k = k_cache[meta.block_tables].flatten(1, 2).transpose(1, 2)  # [B, Hkv, S, D]
    v = v_cache[meta.block_tables].flatten(1, 2).transpose(1, 2)  # [B, Hkv, S, D]
    qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.decode_mask)
    return out.reshape(num_seqs, num_heads, head_dim)
