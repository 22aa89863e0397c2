"""Loader: config parsing (both rope formats), presets (shapes, seeded determinism across processes),
and clear errors for directories that do not fit."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moriio_ray.config import ModelConfig
from moriio_ray.engine.arch import from_hf_config
from moriio_ray.engine.loader import load_model, model_args, resolve_max_model_len
from moriio_ray.engine.model import CausalLM
from moriio_ray.engine.presets import PRESET_TABLE
from moriio_ray.errors import ConfigError

_HASH = """
import hashlib, torch
from moriio_ray.config import ModelConfig
from moriio_ray.engine.loader import load_model
m = load_model(ModelConfig(preset="tiny", seed={seed}), torch.device("cpu"), torch.float32, 64)
h = hashlib.sha256()
for name, p in sorted(m.state_dict().items()):
    h.update(name.encode()); h.update(p.numpy().tobytes())
print(h.hexdigest())
"""


def _weights_hash(seed: int) -> str:
    model = load_model(ModelConfig(preset="tiny", seed=seed), torch.device("cpu"), torch.float32, 64)
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.numpy().tobytes())
    return h.hexdigest()


@pytest.mark.timeout(60)
def test_preset_weights_are_identical_in_every_process() -> None:
    here = _weights_hash(0)
    other = subprocess.run(
        [sys.executable, "-c", _HASH.format(seed=0)], capture_output=True, text=True, check=True, timeout=50
    ).stdout.strip()
    assert here == other
    assert _weights_hash(1) != here


@pytest.mark.timeout(30)
def test_big_presets_have_the_public_shapes() -> None:
    expected_params = {"llama-1b": 1.236e9, "qwen3-0.6b": 0.596e9, "llama-8b": 8.03e9}
    for name, count in expected_params.items():
        with torch.device("meta"):
            model = CausalLM(PRESET_TABLE[name].args, max_positions=16)
        total = sum(p.numel() for p in model.parameters())
        assert abs(total - count) / count < 0.01, (name, total)


@pytest.mark.timeout(10)
def test_config_formats_and_limits() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 64,
    }  # fmt: skip
    old = from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", "factor": 8.0}})
    new = from_hf_config(
        {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}
    )
    assert old.rope == new.rope and old.rope.theta == 5e5 and old.rope.rope_type == "llama3"
    with pytest.raises(ConfigError, match="rope_scaling type 'yarn'"):
        from_hf_config({**base, "rope_scaling": {"rope_type": "yarn"}})
    with pytest.raises(ConfigError, match="not supported"):
        from_hf_config({**base, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    mistral = from_hf_config({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 32})
    assert resolve_max_model_len(mistral, None) == 32
    with pytest.raises(ConfigError, match="max_model_len"):
        resolve_max_model_len(mistral, 33)
    qwen2 = from_hf_config({**base, "model_type": "qwen2", "architectures": None, "sliding_window": 32})
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.sliding_window is None
    with pytest.raises(ConfigError, match="missing field 'hidden_size'"):
        from_hf_config({k: v for k, v in base.items() if k != "hidden_size"})


@pytest.mark.timeout(30)
def test_directory_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="never downloaded"):
        model_args(ModelConfig(preset=None, path=str(tmp_path / "nope")))
    cfg = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = ModelConfig(preset=None, path=str(tmp_path))
    with pytest.raises(ConfigError, match=r"no \*\.safetensors"):
        load_model(config, torch.device("cpu"), torch.float32, 16)
    save_file({"model.embed_tokens.weight": torch.zeros(10, 8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="missing"):
        load_model(config, torch.device("cpu"), torch.float32, 16)
    save_file({"model.embed_tokens.weight": torch.zeros(10, 9)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="shape"):
        load_model(config, torch.device("cpu"), torch.float32, 16)
    save_file({"model.extra.weight": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="no place"):
        load_model(config, torch.device("cpu"), torch.float32, 16)
