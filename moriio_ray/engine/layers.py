"""Building blocks of the decoder: RMSNorm, rotary embedding (default, linear, llama3) and the gated MLP."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moriio_ray.engine.arch import ACTIVATIONS, RopeArgs
from moriio_ray.engine.tp import SINGLE, TPGroup, row_linear


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, through torch's fused kernel (one launch on CUDA).

    It accumulates in float32 and scales before rounding; the HF reference rounds before scaling,
    so in bfloat16 the two can differ by one unit in the last place.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inv_freq(head_dim: int, rope: RopeArgs) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32), with linear or llama3 scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed float32 cos/sin table over ``max_positions``."""

    cos_sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, rope: RopeArgs) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope = rope
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)

    def build(self, device: torch.device) -> None:
        """(Re)compute the table on ``device``; called once the module has real storage."""
        inv_freq = rope_inv_freq(self.head_dim, self.rope)
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, 1, head_dim] in ``dtype``, for positions [T]; shared by every layer."""
        cos, sin = self.cos_sin[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2]
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, D] with cos/sin [T, 1, D]."""
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


_GATE_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
assert set(_GATE_ACTS) == set(ACTIVATIONS)


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up merged into one projection.

    ``act`` is the checkpoint's ``hidden_act``: silu (SwiGLU, the default) or a GELU (GeGLU).
    Under tensor parallelism ``intermediate_size`` is one rank's rows: ``gate_up_proj`` is
    column-parallel (this rank's gate rows, then its up rows) and ``down_proj`` row-parallel.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        hidden_act: str = "silu",
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.act_name = hidden_act
        self.act = _GATE_ACTS[hidden_act]  # ModelArgs refuses any other value with a ConfigError
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = row_linear(intermediate_size, hidden_size, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
