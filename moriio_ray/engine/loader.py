"""Build a CausalLM from a named preset (seeded random weights), a local HF directory or a GGUF file.

Nothing is ever downloaded. ``model.path`` names one of:
- a directory with ``config.json`` and ``*.safetensors`` (one file, or shards listed in
  ``model.safetensors.index.json``);
- a ``.gguf`` file (``gguf_arch``, ``gguf_loader``);
- a model that a pip package ships, by name (``model_path``).

Preset weights are generated on the target device, one parameter at a time from a generator seeded
by (seed, parameter name), so every process that builds the same preset with the same seed gets
bit-identical weights.

Under tensor parallelism (``tp``) each rank builds its share of the model (``tp.shard_args``) and
loads only its slices (``tp_shard.WeightShards``): from safetensors it reads just those slices; a
GGUF tensor is dequantized whole and then cut (its quantized blocks run along the rows); a
preset's parameter is drawn whole on the device, one at a time, and cut, so that every TP size
gets the very weights of size 1.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from safetensors import safe_open

from moriio_ray.config import SIM, ModelConfig
from moriio_ray.engine.arch import ModelArgs, from_hf_config
from moriio_ray.engine.gguf_arch import args_from_gguf
from moriio_ray.engine.gguf_file import open_gguf
from moriio_ray.engine.gguf_loader import load_gguf_weights
from moriio_ray.engine.model import CausalLM
from moriio_ray.engine.model_path import model_source
from moriio_ray.engine.presets import Preset, get_preset, preset_args
from moriio_ray.engine.tp import SINGLE, TPGroup, shard_args
from moriio_ray.engine.tp_shard import WeightShards, apply_cut
from moriio_ray.engine.weight_sink import WeightSink
from moriio_ray.errors import ConfigError


def model_args(config: ModelConfig) -> ModelArgs:
    """The architecture a ModelConfig names (reads only metadata: ``config.json`` or the GGUF header)."""
    if config.preset is not None:
        return preset_args(config)
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


def load_model(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    tp: TPGroup = SINGLE,
) -> CausalLM:
    """A CausalLM on ``device`` in ``dtype``, with weights from the preset, the directory or the GGUF
    file; under tensor parallelism, rank ``tp.rank``'s share of it."""
    assert config.preset != SIM, "the simulated model has no weights (rank.build_rank builds it)"
    args = model_args(config)
    shards = WeightShards(args, tp)
    with torch.device("meta"):
        model = CausalLM(shard_args(args, tp.size), max_positions=max_model_len, tp=tp)
    model = model.to(dtype=dtype).to_empty(device=device)
    if config.preset is not None:
        init_random(model, get_preset(config.preset), config.seed, shards)
    else:
        source = model_source(config)
        if source.is_file():
            load_gguf_weights(model, open_gguf(source), shards)
        else:
            load_safetensors(model, source, shards)
    model.rotary.build(device)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def init_random(model: CausalLM, preset: Preset, seed: int, shards: WeightShards | None = None) -> None:
    """Seeded random weights, each parameter from its own generator on the parameter's device
    (a sharded parameter is drawn at its full shape and cut, so each rank gets its slice of it)."""
    full_shapes = _full_shapes(shards.args) if shards is not None and shards.size > 1 else {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        gen = torch.Generator(device=param.device)
        gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF_FFFF)
        std = preset.embed_std if "embed_tokens" in name or "lm_head" in name else preset.linear_std
        cut = shards.param_cut(name) if shards is not None else None
        if cut is None:
            param.normal_(0.0, std, generator=gen)
            continue
        full = torch.empty(full_shapes[name], dtype=param.dtype, device=param.device)
        full.normal_(0.0, std, generator=gen)
        param.copy_(apply_cut(full, cut))


def _full_shapes(args: ModelArgs) -> dict[str, torch.Size]:
    """Every parameter's shape in the unsharded model (built on the meta device: no memory)."""
    with torch.device("meta"):
        full = CausalLM(args, max_positions=1)
    return {name: p.shape for name, p in full.named_parameters()}


@torch.no_grad()
def load_safetensors(model: CausalLM, model_dir: Path, shards: WeightShards | None = None) -> None:
    """Copy every checkpoint tensor into its parameter (casting dtype); ConfigError on gaps or extras.
    Under tensor parallelism only the rank's slice of each tensor is read from the file."""
    sink = WeightSink(model, str(model_dir))
    for file in _weight_files(model_dir):
        with safe_open(str(file), framework="pt", device=str(sink.device)) as f:
            for name in f.keys():
                if sink.wanted(name):
                    cut = shards.checkpoint_cut(name) if shards is not None else None
                    sink.put(name, _read(f, name, cut), where=file.name)
    sink.finish()


def _read(f: object, name: str, cut: tuple[int, list[slice]] | None) -> torch.Tensor:
    """A checkpoint tensor, or only the slice ``cut`` of it (one contiguous slice along one dim)."""
    if cut is None:
        return f.get_tensor(name)  # type: ignore[attr-defined,no-any-return]
    dim, (part,) = cut
    view = f.get_slice(name)  # type: ignore[attr-defined]
    tensor: torch.Tensor = view[part] if dim == 0 else view[:, part]
    return tensor


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
