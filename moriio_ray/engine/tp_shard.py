"""Which slice of each full weight one tensor-parallel rank keeps.

``WeightShards`` answers for checkpoint tensors under their HF names (``q_proj``, ``gate_proj``,
...), so that a loader reads only the rank's part, and for the model's merged parameters
(``qkv_proj``, ``gate_up_proj``), so that a preset's full random tensor is cut the same way. At
size 1 every answer is None: nothing is sliced.

Column-parallel (dim 0): q/k/v rows of the rank's heads, gate/up rows of its intermediate slice,
and their biases. Row-parallel (dim 1): o_proj and down_proj input columns; their biases stay whole.
Everything else (embedding, norms, LM head, q/k norms) is replicated.
"""

from __future__ import annotations

import torch

from moriio_ray.engine.arch import ModelArgs
from moriio_ray.engine.tp import TPGroup
from moriio_ray.engine.tp_size import shard_range

Cut = tuple[int, list[slice]]  # (dimension, slices of the full tensor, concatenated in order)


class WeightShards:
    """Slices of the full model's tensors that ``tp.rank`` keeps (``args`` is the full model)."""

    def __init__(self, args: ModelArgs, tp: TPGroup) -> None:
        self.args = args
        self.size = tp.size
        rank, size = tp.rank, tp.size
        d = args.head_dim
        heads = shard_range(args.num_heads, rank, size)
        kv_heads = shard_range(args.num_kv_heads, rank, size)
        inter = shard_range(args.intermediate_size, rank, size)
        self.q = slice(heads.start * d, heads.stop * d)
        self.kv = slice(kv_heads.start * d, kv_heads.stop * d)
        self.inter = slice(inter.start, inter.stop)

    def checkpoint_cut(self, name: str) -> Cut | None:
        """The cut of HF checkpoint tensor ``name`` this rank keeps; None: the whole tensor."""
        if self.size == 1:
            return None
        piece = _piece(name)
        is_weight = name.endswith(".weight")
        if piece == "q_proj":
            return 0, [self.q]
        if piece in ("k_proj", "v_proj"):
            return 0, [self.kv]
        if piece in ("gate_proj", "up_proj"):
            return 0, [self.inter]
        if piece == "o_proj" and is_weight:
            return 1, [self.q]
        if piece == "down_proj" and is_weight:
            return 1, [self.inter]
        return None

    def param_cut(self, name: str) -> Cut | None:
        """The cut of the full merged parameter ``name`` (a model parameter name) this rank keeps."""
        if self.size == 1:
            return None
        a = self.args
        piece = _piece(name)
        if piece == "qkv_proj":
            q, k = a.q_size, a.kv_size
            return 0, [self.q, _shift(self.kv, q), _shift(self.kv, q + k)]
        if piece == "gate_up_proj":
            return 0, [self.inter, _shift(self.inter, a.intermediate_size)]
        return self.checkpoint_cut(name)


def apply_cut(tensor: torch.Tensor, cut: Cut | None) -> torch.Tensor:
    """The rank's part of a full tensor (the tensor itself when ``cut`` is None)."""
    if cut is None:
        return tensor
    dim, slices = cut
    parts = [tensor.narrow(dim, s.start, s.stop - s.start) for s in slices]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _piece(name: str) -> str:
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else ""


def _shift(s: slice, by: int) -> slice:
    return slice(s.start + by, s.stop + by)
