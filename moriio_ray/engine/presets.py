"""Named presets: realistic architectures with seeded random weights (no checkpoint needed).

``tiny`` is for tests: small enough for CPU tests in seconds, and initialised so that its logits are
well spread (logit std about 8; a median top-1/top-2 gap near 2, against float32 rounding of about
1e-5), so greedy argmax never hinges on float rounding between batch compositions, while its
outputs still depend on the whole context. The others copy the shapes of public checkpoints.
``sim`` has no weights (``sim_model``): its architecture is its KV geometry, from ``model.sim``.
"""

from __future__ import annotations

import dataclasses

from moriio_ray.config import SIM, ModelConfig, SimConfig
from moriio_ray.engine.arch import ModelArgs, RopeArgs
from moriio_ray.errors import ConfigError

BYTE_VOCAB_SIZE = 260  # 256 byte ids + bos, eos, pad, unk (see tokenizer.ByteTokenizer)


@dataclasses.dataclass(frozen=True)
class Preset:
    """An architecture plus the scales of its random initialisation."""

    args: ModelArgs
    linear_std: float  # std of every projection weight
    embed_std: float  # std of the token embedding (and of lm_head when untied)


_LLAMA3_ROPE = RopeArgs(
    theta=500000.0,
    rope_type="llama3",
    factor=32.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)


def sim_args(sim: SimConfig) -> ModelArgs:
    """The simulated model's architecture: its KV cache's geometry and its vocabulary. It has no
    weights, so the other sizes are nominal (one query head per KV head, llama-1b's context)."""
    hidden_size = sim.num_kv_heads * sim.head_dim
    return ModelArgs(
        model_type="llama",
        vocab_size=sim.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_layers=sim.num_layers,
        num_heads=sim.num_kv_heads,
        num_kv_heads=sim.num_kv_heads,
        head_dim=sim.head_dim,
        max_position_embeddings=131072,
    )


PRESET_TABLE: dict[str, Preset] = {
    "tiny": Preset(
        ModelArgs(
            model_type="llama",
            vocab_size=BYTE_VOCAB_SIZE,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            max_position_embeddings=8192,  # room for bench/engine_bench.py's 4,096-token prompt
            tie_word_embeddings=False,  # tied, the embedding's self-similarity makes it echo its input
        ),
        linear_std=0.15,
        embed_std=1.0,
    ),
    "llama-1b": Preset(  # Llama-3.2-1B shape
        ModelArgs(
            model_type="llama",
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            head_dim=64,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope=_LLAMA3_ROPE,
            tie_word_embeddings=True,
        ),
        linear_std=0.02,
        embed_std=0.05,
    ),
    "qwen3-0.6b": Preset(  # Qwen3-0.6B shape
        ModelArgs(
            model_type="qwen3",
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_layers=28,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope=RopeArgs(theta=1000000.0),
            tie_word_embeddings=True,
            qk_norm=True,
        ),
        linear_std=0.02,
        embed_std=0.07,
    ),
    "llama-8b": Preset(  # Llama-3.1-8B shape
        ModelArgs(
            model_type="llama",
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope=dataclasses.replace(_LLAMA3_ROPE, factor=8.0),
            tie_word_embeddings=False,
        ),
        linear_std=0.02,
        embed_std=0.035,
    ),
}


def preset_args(model: ModelConfig) -> ModelArgs:
    """The architecture of the preset a ModelConfig names: a table entry's, or ``sim``'s geometry."""
    assert model.preset is not None
    if model.preset == SIM:
        assert model.sim is not None  # ModelConfig fills it in for preset sim
        return sim_args(model.sim)
    return get_preset(model.preset).args


def get_preset(name: str) -> Preset:
    """The preset called ``name``, or ConfigError listing the known ones."""
    preset = PRESET_TABLE.get(name)
    if preset is None:
        raise ConfigError(f"model.preset: {name!r} is not one of {', '.join(PRESET_TABLE)}")
    return preset
