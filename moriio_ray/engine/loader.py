"""Build a CausalLM from a local HF-format directory or from a named preset with seeded random weights.

Nothing is ever downloaded. A directory holds ``config.json`` and ``*.safetensors`` (one file, or
shards listed in ``model.safetensors.index.json``). Preset weights are generated on the target
device, one parameter at a time from a generator seeded by (seed, parameter name), so every process
that builds the same preset with the same seed gets bit-identical weights.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from safetensors import safe_open

from moriio_ray.config import ModelConfig
from moriio_ray.engine.arch import ModelArgs, from_hf_config
from moriio_ray.engine.model import CausalLM
from moriio_ray.engine.presets import Preset, get_preset
from moriio_ray.errors import ConfigError

# checkpoint piece -> (merged parameter, index of the piece inside it)
_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def model_args(config: ModelConfig) -> ModelArgs:
    """The architecture a ModelConfig names (reads only ``config.json`` for a directory)."""
    if config.preset is not None:
        return get_preset(config.preset).args
    return from_hf_config(_read_json(_model_dir(config) / "config.json"))


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
    """A CausalLM on ``device`` in ``dtype``, with weights from the preset or the directory."""
    args = model_args(config)
    with torch.device("meta"):
        model = CausalLM(args, max_positions=max_model_len)
    model = model.to(dtype=dtype).to_empty(device=device)
    if config.preset is not None:
        init_random(model, get_preset(config.preset), config.seed)
    else:
        load_safetensors(model, _model_dir(config))
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


def _target(name: str) -> tuple[str, int | None]:
    """Checkpoint tensor name -> (parameter name, piece index in a merged parameter or None)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _MERGED:
            merged, piece = _MERGED[part]
            return ".".join([*parts[:i], merged, *parts[i + 1 :]]), piece
    return name, None


def _piece_rows(model: CausalLM, param_name: str, piece: int) -> slice:
    args = model.args
    sizes = (
        [args.q_size, args.kv_size, args.kv_size]
        if "qkv_proj" in param_name
        else [args.intermediate_size, args.intermediate_size]
    )
    start = sum(sizes[:piece])
    return slice(start, start + sizes[piece])


@torch.no_grad()
def load_safetensors(model: CausalLM, model_dir: Path) -> None:
    """Copy every checkpoint tensor into its parameter (casting dtype); ConfigError on gaps or extras."""
    params = dict(model.named_parameters())
    loaded: dict[str, int] = {}  # parameter -> number of rows filled
    device = next(iter(params.values())).device
    for file in _weight_files(model_dir):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                if "rotary_emb" in name or (name == "lm_head.weight" and model.lm_head is None):
                    continue
                target, piece = _target(name)
                param = params.get(target)
                if param is None:
                    raise ConfigError(
                        f"{file.name}: weight {name!r} has no place in a {model.args.model_type} model"
                    )
                dest = param if piece is None else param[_piece_rows(model, target, piece)]
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ConfigError(
                        f"{file.name}: weight {name!r} has shape {tuple(tensor.shape)}, the model "
                        f"expects {tuple(dest.shape)}; config.json does not match the weights"
                    )
                dest.copy_(tensor)
                loaded[target] = loaded.get(target, 0) + dest.shape[0]
    missing = [n for n, p in params.items() if loaded.get(n, 0) != p.shape[0]]
    if missing:
        raise ConfigError(f"{model_dir}: weights missing from the checkpoint: {', '.join(missing[:5])}")


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map", {})
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.path: {model_dir} holds no *.safetensors files")
    return files


def _model_dir(config: ModelConfig) -> Path:
    path = Path(str(config.path)).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model.path: {path} is not a local HF-format directory with config.json "
            "(models are never downloaded)"
        )
    return path


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path.name}: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path.name}: expected a JSON object")
    return data
