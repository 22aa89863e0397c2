"""Paged attention in Triton, reading K/V in place through the block table (CUDA only).

One kernel serves decode (one new token per sequence) and prefill chunks (several new tokens over
a cached prefix): every new token at position p attends to the sequence's tokens 0..p, which sit
in the paged cache (this step's K/V are written there first). The torch path in ``attention.py``
gathers every block of every sequence into a dense copy before attending; at batch 64 on one H200
that gather was half of the decode step (2.4 of 4.7 ms for llama-1b), and this kernel reads each
cached K/V byte once.

Work split: a program takes one tile of ``BLOCK_Q`` new tokens of one sequence, for the query heads
of one KV head (GQA: those heads share every K/V load), and runs an online softmax over the keys
in tiles of ``BLOCK_N``. Decode launches use ``BLOCK_Q = 1``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attn_kernel(
    Q,  # [T, H, D]: this step's new tokens' queries, sequences back to back
    K,  # [num_blocks, block_size, Hkv, D] (any strides)
    V,
    Out,  # [T, H, D]
    TILE_SEQ,  # [num_tiles] int32: the sequence of each tile
    TILE_Q0,  # [num_tiles] int32: the tile's first new token, counted within its sequence
    Q_START,  # [B] int32: the row of each sequence's first new token in Q
    Q_LEN,  # [B] int32: new tokens per sequence
    CTX_LEN,  # [B] int32: tokens in the cache after this step's writes (the last is the newest)
    TABLES,  # [B, max_blocks] int32 or int64
    stride_qt, stride_qh,
    stride_kb, stride_ko, stride_kh,
    stride_vb, stride_vo, stride_vh,
    stride_ot, stride_oh,
    stride_tb,
    scale,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up so that BLOCK_Q * GROUP_PAD >= 16 (tl.dot's minimum)
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,  # float32 caches: "ieee" (tl.dot would use TF32); else unused
):  # fmt: skip
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(TILE_SEQ + tile)
    q0 = tl.load(TILE_Q0 + tile)
    q_start = tl.load(Q_START + seq)
    q_len = tl.load(Q_LEN + seq)
    ctx_len = tl.load(CTX_LEN + seq)

    M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, M)
    tok = q0 + rows // GROUP_PAD  # [M]: new-token index within the sequence
    grp = rows % GROUP_PAD  # [M]: query head within the group
    row_ok = (tok < q_len) & (grp < GROUP)
    pos = ctx_len - q_len + tok  # [M]: each query's position; it sees keys 0..pos
    head = kv_head * GROUP + grp
    d = tl.arange(0, HEAD_DIM)

    q_ptr = Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None], other=0.0)  # [M, D]

    m_i = tl.full([M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([M], dtype=tl.float32)
    acc = tl.zeros([M, HEAD_DIM], dtype=tl.float32)
    # causal: no query of this tile sees past its last token's position
    kv_end = tl.minimum(ctx_len, ctx_len - q_len + q0 + BLOCK_Q)
    table = TABLES + seq * stride_tb
    for start in range(0, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # [N]: key positions
        n_ok = n < kv_end
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0)
        off = n % BLOCK_SIZE
        k_ptr = K + block[:, None] * stride_kb + off[:, None] * stride_ko + kv_head * stride_kh + d[None, :]
        v_ptr = V + block[:, None] * stride_vb + off[:, None] * stride_vo + kv_head * stride_vh + d[None, :]
        k = tl.load(k_ptr, mask=n_ok[:, None], other=0.0)  # [N, D]
        v = tl.load(v_ptr, mask=n_ok[:, None], other=0.0)  # [N, D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N] float32
        seen = (n[None, :] <= pos[:, None]) & n_ok[None, :]
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptr = Out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=row_ok[:, None])


@dataclasses.dataclass
class PagedTiles:
    """Host-built launch plan of one step: which (sequence, first new token) each program takes."""

    tile_seq: torch.Tensor  # [num_tiles] int32
    tile_q0: torch.Tensor  # [num_tiles] int32
    q_start: torch.Tensor  # [B] int32
    q_len: torch.Tensor  # [B] int32
    ctx_len: torch.Tensor  # [B] int32
    block_q: int

    @classmethod
    def build(
        cls, q_lens: list[int], ctx_lens: list[int], device: torch.device, block_q: int = 16
    ) -> PagedTiles:
        """Tiles for sequences feeding ``q_lens[b]`` new tokens with ``ctx_lens[b]`` tokens cached
        after this step; ``block_q`` is forced to 1 when every sequence feeds one token (decode)."""
        lens = np.asarray(q_lens, dtype=np.int32)
        block_q = 1 if lens.max(initial=1) == 1 else block_q
        per_seq = -(-lens // block_q)
        tile_seq = np.repeat(np.arange(len(lens), dtype=np.int32), per_seq)
        firsts = np.concatenate([[0], np.cumsum(per_seq)[:-1]]).astype(np.int32)
        tile_q0 = (np.arange(len(tile_seq), dtype=np.int32) - np.repeat(firsts, per_seq)) * block_q
        q_start = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device, non_blocking=True)

        ctx = np.asarray(ctx_lens, dtype=np.int32)
        return cls(dev(tile_seq), dev(tile_q0), dev(q_start), dev(lens), dev(ctx), block_q=block_q)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    tiles: PagedTiles,
    *,
    num_tiles: int | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """q [T, H, D] over the paged cache -> [T, H, D]. ``num_tiles``: the launch's grid (a CUDA graph
    passes its padded count; padding tiles must name a sequence with no new tokens)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1, (
        "head_dim must be contiguous"
    )
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = max(triton.next_power_of_2(group), -(-16 // tiles.block_q))
    out = torch.empty_like(q)
    grid = (tiles.tile_seq.numel() if num_tiles is None else num_tiles, num_kv_heads)
    _paged_attn_kernel[grid](
        q, k_cache, v_cache, out,
        tiles.tile_seq, tiles.tile_q0, tiles.q_start, tiles.q_len, tiles.ctx_len, block_tables,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        head_dim**-0.5,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=tiles.block_q, BLOCK_N=block_n,
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out
