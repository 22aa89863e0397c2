"""Load a GGUF file's weights into a CausalLM: map llama.cpp's tensor names, dequantize, unpermute.

llama.cpp's converter permutes the rows of a Llama checkpoint's q and k projections (weights and
biases) so that its rotary kernel can rotate interleaved pairs; per head, row ``2 * i + j`` of the
file is row ``j * head_dim / 2 + i`` of the HF checkpoint. This loader applies the inverse, as
transformers' GGUF loader does, so the rotate-half RoPE of this engine sees HF's layout. Qwen2 and
Qwen3 files are written unpermuted.
"""

from __future__ import annotations

import torch

from moriio_ray.engine.gguf_dequant import dequantize, type_info
from moriio_ray.engine.gguf_file import GGUFFile
from moriio_ray.engine.model import CausalLM
from moriio_ray.engine.tp_shard import WeightShards, apply_cut
from moriio_ray.engine.weight_sink import WeightSink
from moriio_ray.errors import ConfigError

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp's per-layer names (after ``blk.N.``) -> HF's (after ``model.layers.N.``)
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ConfigError if unknown."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 1 and parts[0] in _GLOBAL:
        return f"{_GLOBAL[parts[0]]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{suffix}"
    raise ConfigError(f"gguf: tensor {gguf_name!r} has no place in this engine's decoder")


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation of w [num_heads * head_dim, ...] (a weight or a bias)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@torch.no_grad()
def load_gguf_weights(model: CausalLM, f: GGUFFile, shards: WeightShards | None = None) -> None:
    """Every tensor of ``f`` into ``model`` (dequantized on the model's device, cast to its dtype);
    under tensor parallelism each tensor is dequantized whole, then cut to the rank's slice."""
    sink = WeightSink(model, f"gguf: {f.path.name}")
    args = shards.args if shards is not None else model.args  # the full model: heads to unpermute
    permuted = f.architecture == "llama"
    for name in f.tensor_names:
        target = hf_name(name)
        if not sink.wanted(target):
            continue
        ggml_type, shape = f.tensor_info(name)
        type_info(ggml_type, name)  # refuse an unsupported type before copying its bytes
        raw = torch.from_numpy(f.tensor_bytes(name)).to(sink.device)
        weights = dequantize(raw, ggml_type, shape, name)  # float32, [rows, cols] or [n]
        if permuted and ".attn_q." in name:
            weights = unpermute_rows(weights, args.num_heads)
        elif permuted and ".attn_k." in name:
            weights = unpermute_rows(weights, args.num_kv_heads)
        cut = shards.checkpoint_cut(target) if shards is not None else None
        sink.put(target, apply_cut(weights, cut))  # cast to the model's dtype on copy
    sink.finish()
