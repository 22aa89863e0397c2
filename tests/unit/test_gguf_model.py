"""GGUF models: metadata -> ModelArgs, weights (names, dequantization, llama.cpp's q/k permutation).

Each test writes a small random HF model as a GGUF file (``gguf_writer``: the gguf package's own
name map, llama.cpp's permutation for Llama) and loads it through ``loader.py``. Float32 files must
give exactly the parameters that loading the same model's safetensors gives (whose logits
``test_model_hf_parity`` checks against transformers); quantized Llama and Qwen2 files must give
exactly the parameters of transformers' own GGUF loader.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402

from moriio_ray.config import ModelConfig  # noqa: E402
from moriio_ray.engine.loader import load_model, model_args  # noqa: E402
from moriio_ray.errors import ConfigError  # noqa: E402
from tests.unit.gguf_writer import write_model  # noqa: E402

SMALL = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
)  # fmt: skip
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}),  # head_dim != hidden / heads
}
QUANTIZED = {"token_embd": QT.Q8_0, "blk.0.": QT.Q4_0, "blk.1.": QT.Q4_1, "output.": QT.F16}


def _hf_model(case: str) -> Any:
    cls_name, extra = CASES[case]
    config = getattr(transformers, cls_name)(**SMALL, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(
                1.0 + 0.2 * torch.randn_like(param) if "norm" in name else 0.1 * torch.randn_like(param)
            )
    return model


def _ours(path: Path) -> dict[str, torch.Tensor]:
    model = load_model(ModelConfig(path=str(path)), torch.device("cpu"), torch.float32, 128)
    return model.state_dict()


def _assert_same(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == reference.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CASES))
def test_float32_file_gives_the_checkpoint_weights(case: str, tmp_path: Path) -> None:
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    write_model(tmp_path / "m.gguf", case, hf.config, hf.state_dict())
    args = model_args(ModelConfig(path=str(tmp_path / "m.gguf")))
    expected = model_args(ModelConfig(path=str(tmp_path / "hf")))
    # GGUF stores float32 metadata: eps 1e-5 comes back as 9.99999975e-06
    assert args == dataclasses.replace(expected, rms_norm_eps=args.rms_norm_eps), (args, expected)
    assert args.rms_norm_eps == pytest.approx(expected.rms_norm_eps, rel=1e-6)
    _assert_same(_ours(tmp_path / "m.gguf"), _ours(tmp_path / "hf"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["llama", "qwen2"])
def test_quantized_file_equals_transformers_gguf_loader(case: str, tmp_path: Path) -> None:
    hf = _hf_model(case)
    write_model(tmp_path / "m.gguf", case, hf.config, hf.state_dict(), QUANTIZED)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf").eval()
    ref = reference.state_dict()
    args = model_args(ModelConfig(path=str(tmp_path / "m.gguf")))
    ours = _ours(tmp_path / "m.gguf")
    for name, tensor in ref.items():
        if name == "lm_head.weight" and args.tie_word_embeddings:
            continue
        parts = name.split(".")
        merged = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
        merged |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
        layer = ".".join(merged.get(part, part) for part in parts)
        piece = ours[layer]
        if "qkv_proj" in layer:
            q, kv = args.q_size, args.kv_size
            start = {"q_proj": 0, "k_proj": q, "v_proj": q + kv}[name.split(".")[-2]]
            piece = piece[start : start + (q if "q_proj" in name else kv)]
        elif "gate_up_proj" in layer:
            start = 0 if "gate_proj" in name else args.intermediate_size
            piece = piece[start : start + args.intermediate_size]
        assert torch.equal(piece, tensor.float()), name
    # and the quantization was real: the weights moved from the float ones
    assert not torch.equal(
        ref["model.layers.0.self_attn.q_proj.weight"],
        hf.state_dict()["model.layers.0.self_attn.q_proj.weight"],
    )


@pytest.mark.timeout(60)
def test_gguf_refusals(tmp_path: Path) -> None:
    hf = _hf_model("llama")
    write_model(tmp_path / "m.gguf", "llama", hf.config, hf.state_dict(), {"blk.0.attn_q": QT.Q5_0})
    with pytest.raises(ConfigError, match=r"'blk.0.attn_q.weight' has type Q5_0, which is not supported"):
        load_model(ModelConfig(path=str(tmp_path / "m.gguf")), torch.device("cpu"), torch.float32, 128)
    with pytest.raises(ConfigError, match="neither a GGUF file nor a local HF-format directory"):
        model_args(ModelConfig(path=str(tmp_path / "missing.gguf")))
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 12)
    with pytest.raises(ConfigError, match="is not a readable GGUF file"):
        model_args(ModelConfig(path=str(tmp_path / "bad.gguf")))
    write_model(
        tmp_path / "rope.gguf", "llama", hf.config, {}, vocab={"rope_scaling_type": gguf.RopeScalingType.YARN}
    )
    with pytest.raises(
        ConfigError, match=r"llama.rope.scaling.type 'yarn' is not supported; supported: none"
    ):
        model_args(ModelConfig(path=str(tmp_path / "rope.gguf")))
