"""``hidden_act`` is read from config.json: silu (SwiGLU) and the GELUs (GeGLU) compute as in
transformers; anything else is a ConfigError rather than silently wrong numbers."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.activations import ACT2FN  # noqa: E402

from moriio_ray.engine.arch import from_hf_config  # noqa: E402
from moriio_ray.engine.layers import SwiGLU  # noqa: E402
from moriio_ray.errors import ConfigError  # noqa: E402

BASE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
    "num_hidden_layers": 1, "num_attention_heads": 2,
}  # fmt: skip


@pytest.mark.timeout(10)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh"])
def test_gated_mlp_matches_transformers_activation(act: str) -> None:
    args = from_hf_config({**BASE, "hidden_act": act})
    assert args.hidden_act == act
    torch.manual_seed(0)
    mlp = SwiGLU(args.hidden_size, args.intermediate_size, bias=False, hidden_act=args.hidden_act)
    x = torch.randn(5, args.hidden_size)
    gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    expected = mlp.down_proj(ACT2FN[act](gate) * up)
    torch.testing.assert_close(mlp(x), expected, atol=0, rtol=0)


@pytest.mark.timeout(10)
def test_activations_differ_and_default_is_silu() -> None:
    assert from_hf_config(BASE).hidden_act == "silu"
    x = torch.linspace(-3, 3, 7)
    outs = {a: SwiGLU(1, 1, False, a).act(x) for a in ("silu", "gelu", "gelu_pytorch_tanh")}
    assert not torch.allclose(outs["silu"], outs["gelu"])
    assert not torch.equal(outs["gelu"], outs["gelu_pytorch_tanh"])


@pytest.mark.timeout(10)
def test_other_activations_are_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"hidden_act: 'relu' is not supported; supported: silu, gelu, gelu_pytorch_tanh"
    ):
        from_hf_config({**BASE, "hidden_act": "relu"})
