"""The Triton kernels against the torch path they replace, on the GPU (float32 and bfloat16).

- paged attention over the block table: decode (one new token per sequence) and prefill chunks over
  a cached prefix, mixed in one launch plan, GQA groups of 1, 3, 4 and 8, both cache layouts
  (layer-major views and block-major strided views), block sizes 4 and 16;
- the fused element-wise kernels: residual add + RMSNorm, rotary + K/V slot writes, SiLU * up.
"""

from __future__ import annotations

import math

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

TOL = {"float32": 2e-5, "bfloat16": 2e-2}


def _reference_attention(q, kc, vc, tables, q_lens, ctx_lens):  # type: ignore[no-untyped-def]
    import torch

    outs, start = [], 0
    heads, group, block = q.shape[1], q.shape[1] // kc.shape[2], kc.shape[1]
    for b, (ql, cl) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        pos = torch.arange(cl, device=q.device)
        k = kc[tables[b][pos // block], pos % block].float().repeat_interleave(group, 1)
        v = vc[tables[b][pos // block], pos % block].float().repeat_interleave(group, 1)
        s = torch.einsum("thd,nhd->htn", q[start : start + ql].float(), k) / math.sqrt(q.shape[2])
        qpos = torch.arange(cl - ql, cl, device=q.device)
        s = s.masked_fill(pos[None, None, :] > qpos[None, :, None], float("-inf"))
        outs.append(torch.einsum("htn,nhd->thd", s.softmax(-1), v))
        start += ql
    assert heads == outs[0].shape[1]
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(4, 4, 64, 16), (32, 8, 64, 16), (12, 4, 128, 4), (16, 2, 64, 16)])
@pytest.mark.parametrize("layout", ["layer_major", "block_major"])
def test_paged_attention_equals_the_reference(
    dtype: str, shape: tuple[int, int, int, int], layout: str
) -> None:
    import torch

    from moriio_ray.engine.triton_attention import PagedTiles, paged_attention

    heads, kv_heads, head_dim, block = shape  # query heads, KV heads, head size, tokens per block
    torch.manual_seed(0)
    dt, dev, num_blocks = getattr(torch, dtype), torch.device("cuda"), 256
    if layout == "layer_major":
        kc = torch.randn(num_blocks, block, kv_heads, head_dim, device=dev, dtype=dt)
        vc = torch.randn_like(kc)
    else:
        full = torch.randn(num_blocks, 2, 2, block, kv_heads, head_dim, device=dev, dtype=dt)
        kc, vc = full[:, 1, 0], full[:, 1, 1]
    for q_lens, extra in (([1] * 9, 70), ([5, 1, 17, 3, 64], 40), ([200], 300), ([1, 33, 1], 0)):
        ctx = [n + (i * 13 + extra) % (extra + 1) for i, n in enumerate(q_lens)]
        width = max(-(-c // block) for c in ctx)
        tables = torch.stack([torch.randperm(num_blocks, device=dev)[:width] for _ in q_lens])
        q = torch.randn(sum(q_lens), heads, head_dim, device=dev, dtype=dt)
        out = paged_attention(q, kc, vc, tables, PagedTiles.build(q_lens, ctx, dev))
        ref = _reference_attention(q, kc, vc, tables, q_lens, ctx)
        assert (out.float() - ref).abs().max().item() < TOL[dtype], (q_lens, ctx)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_elementwise_kernels_equal_the_torch_ops(dtype: str) -> None:
    import torch
    import torch.nn.functional as F

    from moriio_ray.engine.layers import apply_rotary
    from moriio_ray.engine.triton_fused import add_rms_norm, rotary_kv_write, silu_mul

    torch.manual_seed(0)
    dt, dev, tol = getattr(torch, dtype), torch.device("cuda"), TOL[dtype]
    x, r, w = (torch.randn(n, device=dev, dtype=dt) for n in ((7, 2048), (7, 2048), (2048,)))
    out, summed = add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(summed, x + r)
    ref = F.rms_norm((x + r).float(), (2048,), w.float(), 1e-5)
    assert (out.float() - ref).abs().max().item() < tol * 8
    gate_up = torch.randn(7, 2 * 8192, device=dev, dtype=dt)
    ref_mlp = F.silu(gate_up[:, :8192].float()) * gate_up[:, 8192:].float()
    assert (silu_mul(gate_up).float() - ref_mlp).abs().max().item() < tol * 8
    heads, kv_heads, head_dim, num_blocks, block = 32, 8, 64, 64, 16
    qkv = torch.randn(7, (heads + 2 * kv_heads) * head_dim, device=dev, dtype=dt)
    table = torch.randn(4096, head_dim, device=dev)
    pos = torch.tensor([3, 7, 0, 4095, 42, 17, 100], device=dev)
    blocks = torch.tensor([1, 2, 3, 63, 0, 5, 9], device=dev)
    offsets = torch.tensor([0, 3, 1, 15, 0, 2, 7], device=dev)
    kc = torch.zeros(num_blocks, block, kv_heads, head_dim, device=dev, dtype=dt)
    vc = torch.zeros_like(kc)
    q = rotary_kv_write(qkv, table, pos, blocks, offsets, kc, vc, heads, kv_heads)
    cos, sin = table[pos].unsqueeze(1).chunk(2, -1)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    qk = apply_rotary(
        qkv[:, : (heads + kv_heads) * head_dim].view(7, heads + kv_heads, head_dim).float(), cos, sin
    )
    assert (q.float() - qk[:, :heads]).abs().max().item() < tol * 4
    assert (kc[blocks, offsets].float() - qk[:, heads:]).abs().max().item() < tol * 4
    assert torch.equal(
        vc[blocks, offsets], qkv[:, (heads + kv_heads) * head_dim :].view(7, kv_heads, head_dim)
    )
