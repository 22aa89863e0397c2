"""ModelArgs from a GGUF file's metadata (llama.cpp's key names) and its tensor names.

Supported architectures: ``llama`` (Llama 1/2/3, and Mistral, which llama.cpp also writes as
``llama``), ``qwen2`` and ``qwen3``. What the metadata does not state, the tensors do:
llama.cpp writes ``output.weight`` only when the embedding is untied, and biases or q/k norms only
where the model has them.
"""

from __future__ import annotations

from typing import Any

from moriio_ray.engine.arch import ModelArgs, RopeArgs
from moriio_ray.engine.gguf_file import GGUFFile
from moriio_ray.errors import ConfigError

ARCHITECTURES = ("llama", "qwen2", "qwen3")
_ROPE_SCALING = ("none", "linear")


def _one(value: Any, key: str) -> int:
    """A per-model count; llama.cpp may write it per layer, which this engine supports when uniform."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ConfigError(f"gguf: {key} differs between layers ({sorted(set(value))}); not supported")
        value = value[0]
    return int(value)


def _rope(f: GGUFFile, arch: str) -> RopeArgs:
    theta = float(f.value(f"{arch}.rope.freq_base", 10000.0))
    scaling = str(f.value(f"{arch}.rope.scaling.type", "none"))
    if scaling not in _ROPE_SCALING:
        raise ConfigError(
            f"gguf: {arch}.rope.scaling.type {scaling!r} is not supported; "
            f"supported: {', '.join(_ROPE_SCALING)}"
        )
    if "rope_freqs.weight" in f.tensor_names:
        # llama.cpp stores Llama 3.1+ rope scaling as per-frequency factors, not as parameters
        raise ConfigError("gguf: per-frequency rope factors (rope_freqs.weight) are not supported")
    context = int(
        f.value(f"{arch}.rope.scaling.original_context_length", f.value(f"{arch}.context_length", 2048))
    )
    if scaling == "linear":
        factor = float(f.value(f"{arch}.rope.scaling.factor"))
        return RopeArgs(
            theta=theta, rope_type="linear", factor=factor, original_max_position_embeddings=context
        )
    return RopeArgs(theta=theta, original_max_position_embeddings=context)


def args_from_gguf(f: GGUFFile) -> ModelArgs:
    """The architecture a GGUF file describes; ConfigError for anything this engine cannot run."""
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"gguf: architecture {arch!r} of {f.path.name} is not supported; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    names = set(f.tensor_names)
    if int(f.value(f"{arch}.expert_count", 0)) > 0:
        raise ConfigError(f"gguf: {f.path.name} is a mixture-of-experts model; not supported")
    hidden = int(f.value(f"{arch}.embedding_length"))
    heads = _one(f.value(f"{arch}.attention.head_count"), "attention.head_count")
    kv_heads = _one(f.value(f"{arch}.attention.head_count_kv", heads), "attention.head_count_kv")
    head_dim = int(f.value(f"{arch}.attention.key_length", hidden // heads))
    for key in ("attention.value_length", "rope.dimension_count"):
        if int(f.value(f"{arch}.{key}", head_dim)) != head_dim:
            raise ConfigError(f"gguf: {arch}.{key} differs from the head size {head_dim}; not supported")
    vocab = f.value(f"{arch}.vocab_size", None)
    if vocab is None:
        vocab = len(f.value("tokenizer.ggml.tokens"))
    return ModelArgs(
        model_type=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=_one(f.value(f"{arch}.feed_forward_length"), "feed_forward_length"),
        num_layers=int(f.value(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(f.value(f"{arch}.context_length", 2048)),
        rms_norm_eps=float(f.value(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope=_rope(f, arch),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        hidden_act="silu",  # llama.cpp's llama, qwen2 and qwen3 graphs are SwiGLU
    )
