"""ModelArgs: the architecture of a Llama/Qwen-family decoder, read from an HF ``config.json``.

Both config formats are understood: ``rope_theta`` + ``rope_scaling`` (checkpoints written by
transformers 4.x) and ``rope_parameters`` (transformers 5.x).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moriio_ray.errors import ConfigError

# model_type -> (qkv bias, per-head q/k RMSNorm)
FAMILIES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}
_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ROPE_TYPES = ("default", "linear", "llama3")
# the MLP's gate activation: silu (SwiGLU), or GELU exact / tanh-approximated (GeGLU)
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class RopeArgs:
    """Rotary embedding parameters (``rope_type`` default, linear or llama3)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """Everything the model code needs to build a decoder of one of the supported families."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeArgs = dataclasses.field(default_factory=RopeArgs)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None  # attention is exact only up to this length
    hidden_act: str = "silu"  # one of ACTIVATIONS

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"hidden_act: {self.hidden_act!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_key_value_heads: {self.num_kv_heads} does not divide num_attention_heads "
                f"{self.num_heads}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _model_type(cfg: dict[str, Any]) -> str:
    for arch in cfg.get("architectures") or ():
        if arch in _ARCHS:
            return _ARCHS[arch]
    model_type = str(cfg.get("model_type", ""))
    if model_type in FAMILIES:
        return model_type
    names = cfg.get("architectures") or model_type
    raise ConfigError(f"config.json: architecture {names!r} is not supported; supported: {', '.join(_ARCHS)}")


def _rope(cfg: dict[str, Any]) -> RopeArgs:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    params.update(scaling)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"config.json: rope_scaling type {rope_type!r} is not supported; "
            f"use one of {', '.join(ROPE_TYPES)}"
        )
    return RopeArgs(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )


def from_hf_config(cfg: dict[str, Any]) -> ModelArgs:
    """ModelArgs from the parsed ``config.json`` of a Llama, Mistral, Qwen2 or Qwen3 checkpoint."""
    model_type = _model_type(cfg)
    qkv_bias, qk_norm = FAMILIES[model_type]
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        window = cfg.get("sliding_window")
        if model_type.startswith("qwen") and not cfg.get("use_sliding_window", False):
            window = None
        return ModelArgs(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias or bool(cfg.get("attention_bias", False)),
            # Qwen2 has q/k/v bias and no o bias; elsewhere attention_bias covers all four
            o_bias=model_type != "qwen2" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=qk_norm,
            sliding_window=int(window) if window else None,
            hidden_act=str(cfg.get("hidden_act", "silu")),
        )
    except KeyError as exc:
        raise ConfigError(f"config.json: missing field {exc.args[0]!r}") from None
