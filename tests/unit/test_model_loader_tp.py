"""Each tensor-parallel rank loads its slices: put back together, they are the size-1 weights.

For a preset (drawn whole and cut), a safetensors checkpoint (only the slices are read) and a GGUF
file (dequantized, unpermuted, then cut), rank r of 2 must hold: its q, k and v heads and its
gate/up rows (column-parallel), its o_proj/down_proj input columns (row-parallel, whole biases),
and everything else whole.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moriio_ray.config import ModelConfig
from moriio_ray.engine.arch import ModelArgs
from moriio_ray.engine.loader import load_model, model_args
from moriio_ray.engine.tp import TPGroup, shard_args

transformers = pytest.importorskip("transformers")

from tests.unit.gguf_writer import write_model  # noqa: E402
from tests.unit.test_gguf_model import _hf_model  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _params(config: ModelConfig, tp: TPGroup) -> dict[str, torch.Tensor]:
    model = load_model(config, torch.device("cpu"), torch.float32, 64, tp)
    return {k: v.clone() for k, v in model.state_dict().items()}


def reassemble(name: str, parts: list[torch.Tensor], local: ModelArgs) -> torch.Tensor:
    """The full parameter from the ranks' slices, by the sharding rules (not by the loader's code)."""
    if "qkv_proj" in name:
        sizes = [local.q_size, local.kv_size, local.kv_size]
        pieces = [p.split(sizes) for p in parts]
        return torch.cat([torch.cat([pc[i] for pc in pieces]) for i in range(3)])
    if "gate_up_proj" in name:
        pieces = [p.chunk(2) for p in parts]
        return torch.cat([torch.cat([pc[i] for pc in pieces]) for i in range(2)])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return torch.cat(parts, dim=1)
    assert all(torch.equal(p, parts[0]) for p in parts), f"{name} should be replicated"
    return parts[0]


def _check(config: ModelConfig) -> None:
    full = _params(config, TPGroup())
    ranks = [_params(config, TPGroup(r, 2)) for r in range(2)]
    local = shard_args(model_args(config), 2)
    assert ranks[0].keys() == full.keys()
    for name, tensor in full.items():
        parts = [ranks[r][name] for r in range(2)]
        if "proj" in name and "o_proj.bias" not in name and "down_proj.bias" not in name:
            assert parts[0].numel() * 2 == tensor.numel(), f"{name} is not sharded"
        assert torch.equal(reassemble(name, parts, local), tensor), name


def test_preset_shards() -> None:
    _check(ModelConfig(preset="tiny", dtype="float32"))


@pytest.mark.parametrize("case", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_safetensors_and_gguf_shards(case: str, tmp_path: Path) -> None:
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    _check(ModelConfig(path=str(tmp_path / "hf"), dtype="float32"))
    write_model(tmp_path / "m.gguf", case, hf.config, hf.state_dict())  # llama: permuted q/k rows
    _check(ModelConfig(path=str(tmp_path / "m.gguf"), dtype="float32"))
