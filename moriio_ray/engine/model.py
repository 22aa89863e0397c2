"""The decoder: Llama 2/3/3.x, Mistral, Qwen2/2.5 (qkv bias) and Qwen3 (q/k norm) in one module tree.

Parameter names follow the HF checkpoints, except that q/k/v and gate/up are merged into
``qkv_proj`` and ``gate_up_proj`` (the loader stacks the checkpoint's pieces). The same code runs on
CPU and CUDA in float32, bfloat16 and float16.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from moriio_ray.engine.arch import ModelArgs
from moriio_ray.engine.attention import AttnMetadata, attend, write_kv
from moriio_ray.engine.fused_forward import fused_forward
from moriio_ray.engine.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary
from moriio_ray.engine.tp import SINGLE, TPGroup, row_linear

KVPair = tuple[torch.Tensor, torch.Tensor]  # a layer's (k_cache, v_cache): [num_blocks, block_size, Hkv, D]
Rotary = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) of the batch's positions: [T, 1, D] each
LayerHook = Callable[[int], None]


class Attention(nn.Module):
    """GQA self-attention that writes its K/V into the paged cache before attending.

    Under tensor parallelism ``args`` holds one rank's heads (``tp.shard_args``): ``qkv_proj`` is
    column-parallel and ``o_proj`` row-parallel (one all-reduce).
    """

    def __init__(self, args: ModelArgs, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size, self.kv_size = args.q_size, args.kv_size
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = row_linear(self.q_size, args.hidden_size, args.o_bias, tp)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        kv: KVPair,
        meta: AttnMetadata,
    ) -> torch.Tensor:
        num_tokens, heads = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x)  # [T, (H + 2 * Hkv) * D]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])], dim=1)
        qk = apply_rotary(qk, *rotary)  # q and k rotated together: half the kernel launches
        q, k = qk[:, :heads], qk[:, heads:]  # [T, H, D], [T, Hkv, D]
        write_kv(kv[0], kv[1], k, v, meta)
        out = attend(q, k, v, kv[0], kv[1], meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, args: ModelArgs, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, tp)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = SwiGLU(args.hidden_size, args.intermediate_size, args.mlp_bias, args.hidden_act, tp)

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        kv: KVPair,
        meta: AttnMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embedding, the layer stack and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, args: ModelArgs, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)  # replicated under TP
        self.layers = nn.ModuleList([DecoderLayer(args, tp) for _ in range(args.num_layers)])
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class CausalLM(nn.Module):
    """A decoder-only LM over a paged KV cache.

    ``forward`` runs the packed new tokens of a batch (decodes and prefill chunks, as ``meta`` says) and
    returns their final hidden states; ``compute_logits`` turns selected rows into float32 logits.
    Under tensor parallelism ``args`` is one rank's share (``tp.shard_args``) and the LM head is
    replicated, so every rank could compute full logits (only rank 0 samples).
    """

    def __init__(self, args: ModelArgs, max_positions: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.args = args
        self.tp = tp
        self.model = DecoderModel(args, tp)
        self.rotary = RotaryEmbedding(args.head_dim, max_positions, args.rope)
        tied = args.tie_word_embeddings
        self.lm_head = None if tied else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.eps = args.rms_norm_eps
        # CUDA: the Triton forward (engine/fused_forward.py; build_rank sets it from engine.kernels)
        self.fused = False

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVPair],
        meta: AttnMetadata,
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor:
        # input_ids, positions [T] -> hidden [T, hidden_size]
        if self.fused:
            return fused_forward(self, input_ids, positions, kv_caches, meta, layer_hook)
        x = self.model.embed_tokens(input_ids)
        rotary = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rotary, kv_caches[i], meta)
            if layer_hook is not None:
                # layer i's K/V for the whole batch are in the cache now (queued on the stream)
                layer_hook(i)
        return self.model.norm(x)

    @property
    def needs_attention_plan(self) -> bool:
        """Whether the forward reads the runner's per-step attention precomputation (the torch path
        does; the Triton forward reads none)."""
        return not self.fused

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [N, hidden_size] -> logits [N, vocab] float32
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
