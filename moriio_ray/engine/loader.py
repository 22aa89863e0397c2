"""Build a CausalLM from a named preset (seeded random weights), a local HF directory or a GGUF file.

Nothing is ever downloaded. ``model.path`` names one of:
- a directory with ``config.json`` and ``*.safetensors`` (one file, or shards listed in
  ``model.safetensors.index.json``);
- a ``.gguf`` file (``gguf_arch``, ``gguf_loader``);
- a model that a pip package ships, by name (``model_path``).

Preset weights are generated on the target device, one parameter at a time from a generator seeded
by (seed, parameter name), so every process that builds the same preset with the same seed gets
bit-identical weights.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from safetensors import safe_open

from moriio_ray.config import ModelConfig
from moriio_ray.engine.arch import ModelArgs, from_hf_config
from moriio_ray.engine.gguf_arch import args_from_gguf
from moriio_ray.engine.gguf_file import open_gguf
from moriio_ray.engine.gguf_loader import load_gguf_weights
from moriio_ray.engine.model import CausalLM
from moriio_ray.engine.model_path import model_source
from moriio_ray.engine.presets import Preset, get_preset
from moriio_ray.engine.weight_sink import WeightSink
from moriio_ray.errors import ConfigError


def model_args(config: ModelConfig) -> ModelArgs:
    """The architecture a ModelConfig names (reads only metadata: ``config.json`` or the GGUF header)."""
    if config.preset is not None:
        return get_preset(config.preset).args
    source = model_source(config)
    if source.is_file():
        return args_from_gguf(open_gguf(source))
    return from_hf_config(_read_json(source / "config.json"))


def resolve_max_model_len(args: ModelArgs, requested: int | None) -> int:
    """The longest sequence (prompt + output) the engine serves; ConfigError past what the model allows."""
    limit = args.max_position_embeddings
    if args.sliding_window is not None:
        limit = min(limit, args.sliding_window)  # within the window, full attention is exact
    if requested is None:
        return limit
    if requested > limit:
        raise ConfigError(
            f"model.max_model_len: {requested} exceeds what the model supports ({limit}); lower it"
        )
    return requested


def load_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, max_model_len: int) -> CausalLM:
    """A CausalLM on ``device`` in ``dtype``, with weights from the preset, the directory or the GGUF file."""
    args = model_args(config)
    with torch.device("meta"):
        model = CausalLM(args, max_positions=max_model_len)
    model = model.to(dtype=dtype).to_empty(device=device)
    if config.preset is not None:
        init_random(model, get_preset(config.preset), config.seed)
    else:
        source = model_source(config)
        if source.is_file():
            load_gguf_weights(model, open_gguf(source))
        else:
            load_safetensors(model, source)
    model.rotary.build(device)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def init_random(model: CausalLM, preset: Preset, seed: int) -> None:
    """Seeded random weights, each parameter from its own generator on the parameter's device."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        gen = torch.Generator(device=param.device)
        gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF_FFFF)
        std = preset.embed_std if "embed_tokens" in name or "lm_head" in name else preset.linear_std
        param.normal_(0.0, std, generator=gen)


@torch.no_grad()
def load_safetensors(model: CausalLM, model_dir: Path) -> None:
    """Copy every checkpoint tensor into its parameter (casting dtype); ConfigError on gaps or extras."""
    sink = WeightSink(model, str(model_dir))
    for file in _weight_files(model_dir):
        with safe_open(str(file), framework="pt", device=str(sink.device)) as f:
            for name in f.keys():
                if sink.wanted(name):
                    sink.put(name, f.get_tensor(name), where=file.name)
    sink.finish()


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map", {})
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.path: {model_dir} holds no *.safetensors files")
    return files


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path.name}: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path.name}: expected a JSON object")
    return data
