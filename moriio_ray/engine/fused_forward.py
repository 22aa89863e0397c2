"""The decoder's forward pass on CUDA with the Triton kernels (``engine.kernels``: ``triton``).

The same math as ``CausalLM``'s torch path, in fewer launches per layer: a residual add fused into
the next RMSNorm, rotary fused with the K/V slot writes, the gate's activation fused with its
product, and attention that reads the paged cache in place for every row of a mixed batch (decodes
and prefill chunks alike). The CPU, and CUDA with ``engine.kernels: torch``, keep the torch path.
Rounding differs from the torch path in the last bits (float32 rotary and norms), so greedy tokens
of the two paths can part after many steps; each path is deterministic, and every engine of a
pipeline uses the same one.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import torch

from moriio_ray.errors import ConfigError

if TYPE_CHECKING:
    from moriio_ray.engine.attention import AttnMetadata
    from moriio_ray.engine.model import CausalLM, DecoderLayer, KVPair
    from moriio_ray.engine.triton_attention import PagedTiles

KERNELS = ("auto", "torch", "triton")


def use_triton(kernels: str, device: torch.device) -> bool:
    """Whether an engine on ``device`` runs the Triton forward (``auto``: on CUDA, when Triton is
    installed); ConfigError for ``triton`` where it cannot run."""
    available = device.type == "cuda" and importlib.util.find_spec("triton") is not None
    if kernels == "triton" and not available:
        raise ConfigError(
            f"engine.kernels: 'triton' needs a CUDA device and the triton package (device {device}); "
            "use 'auto' or 'torch'"
        )
    return kernels != "torch" and available


def fused_forward(
    lm: CausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: Sequence[KVPair],
    meta: AttnMetadata,
    layer_hook: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """input_ids, positions [T] -> final hidden states [T, hidden_size], as ``CausalLM.forward``."""
    from moriio_ray.engine.triton_attention import paged_attention
    from moriio_ray.engine.triton_fused import add_rms_norm, rotary_kv_write, silu_mul

    tiles = _tiles(meta, input_ids.shape[0], positions)
    assert meta.block_tables is not None, "the runner and the graphs always give the block tables"
    layers = cast("list[DecoderLayer]", list(lm.model.layers))
    num_tokens = input_ids.shape[0]
    h, residual = add_rms_norm(
        lm.model.embed_tokens(input_ids), None, layers[0].input_layernorm.weight, lm.eps
    )
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = attn.qkv_proj(h)  # [T, (H + 2 Hkv) D]
        if attn.q_norm is not None and attn.k_norm is not None:  # Qwen3: norm q and k before rotary
            qk = qkv[:, : attn.q_size + attn.kv_size].view(num_tokens, -1, attn.head_dim)
            qkv = torch.cat(
                [
                    attn.q_norm(qk[:, : attn.num_heads]).flatten(1),
                    attn.k_norm(qk[:, attn.num_heads :]).flatten(1),
                    qkv[:, attn.q_size + attn.kv_size :],
                ],
                dim=1,
            )
        k_cache, v_cache = kv_caches[i]
        q = rotary_kv_write(
            qkv, lm.rotary.cos_sin, positions, meta.slot_blocks, meta.slot_offsets,
            k_cache, v_cache, attn.num_heads, attn.num_kv_heads,
        )  # fmt: skip
        out = paged_attention(q, k_cache, v_cache, meta.block_tables, tiles)  # [T, H, D]
        out = attn.o_proj(out.view(num_tokens, attn.q_size))
        h, residual = add_rms_norm(out, residual, layer.post_attention_layernorm.weight, lm.eps)
        gate_up = mlp.gate_up_proj(h)
        if mlp.act_name == "silu":
            act = silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = mlp.act(gate) * up
        out = mlp.down_proj(act)
        following = layers[i + 1].input_layernorm if i + 1 < len(layers) else lm.model.norm
        h, residual = add_rms_norm(out, residual, following.weight, lm.eps)
        if layer_hook is not None:
            layer_hook(i)  # layer i's K/V for the whole batch are in the cache (queued on the stream)
    return h


def _tiles(meta: AttnMetadata, num_tokens: int, positions: torch.Tensor) -> PagedTiles:
    from moriio_ray.engine.triton_attention import PagedTiles

    if meta.q_lens:  # an eager step: its rows, from the host
        ctx = [s + n for s, n in zip(meta.start_pos, meta.q_lens, strict=True)]
        return PagedTiles.build(meta.q_lens, ctx, positions.device)
    # a captured decode step: one token per row, each at its position (static buffers)
    rows = torch.arange(num_tokens, device=positions.device, dtype=torch.int32)
    ones = torch.ones_like(rows)
    return PagedTiles(rows, rows * 0, rows, ones, (positions + 1).to(torch.int32), block_q=1)
