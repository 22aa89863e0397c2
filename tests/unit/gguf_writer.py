"""Write small GGUF files with ``gguf.GGUFWriter``, the way llama.cpp's converter lays them out.

Tensor names come from the ``gguf`` package's own HF -> GGUF map, and Llama q/k rows get
llama.cpp's permutation, so a loader that gets either wrong fails the tests that read these files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, interleave the two rotary halves of q/k rows."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(values: np.ndarray, qtype: QT) -> np.ndarray:
    """``values`` (float32) in ``qtype``: the array GGUFWriter.add_tensor takes with raw_dtype."""
    if qtype == QT.F32:
        return values.astype(np.float32)
    return gguf.quants.quantize(values.astype(np.float32), qtype)


def write_model(
    path: Path,
    arch: str,
    config: Any,
    state: dict[str, torch.Tensor],
    qtypes: dict[str, QT] | None = None,
    vocab: dict[str, Any] | None = None,
) -> None:
    """An HF state dict (and its config) as a GGUF file; ``qtypes`` maps GGUF name prefixes to types."""
    writer = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = getattr(config, "rope_parameters", None) or {}  # transformers 5; 4.x has config.rope_theta
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or rope.get("rope_theta") or 1e4))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    for key, value in (vocab or {}).items():
        getattr(writer, f"add_{key}")(value)
    names = gguf.get_tensor_name_map(ARCHS[arch], config.num_hidden_layers)
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stem, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(stem)}.{suffix}"
        values = tensor.float().numpy()
        if arch == "llama" and ".self_attn.q_proj." in hf_name:
            values = llama_cpp_permute(values, heads)
        elif arch == "llama" and ".self_attn.k_proj." in hf_name:
            values = llama_cpp_permute(values, kv_heads)
        qtype = next((t for prefix, t in (qtypes or {}).items() if name.startswith(prefix)), QT.F32)
        if values.ndim == 1 or values.shape[-1] % 32:
            qtype = QT.F32  # norms and biases stay float32, as in llama.cpp's files
        writer.add_tensor(name, encode(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
