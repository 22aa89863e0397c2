"""Copy checkpoint tensors, under their HF names, into a CausalLM's merged parameters.

The model merges q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; each checkpoint piece
fills its rows. Every loader (safetensors, GGUF) goes through one ``WeightSink``, which refuses
unknown or misshapen tensors and, at the end, any parameter left unfilled.
"""

from __future__ import annotations

import torch

from moriio_ray.engine.model import CausalLM
from moriio_ray.errors import ConfigError

# checkpoint piece -> (merged parameter, index of the piece inside it)
_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _target(name: str) -> tuple[str, int | None]:
    """Checkpoint tensor name -> (parameter name, piece index in a merged parameter or None)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _MERGED:
            merged, piece = _MERGED[part]
            return ".".join([*parts[:i], merged, *parts[i + 1 :]]), piece
    return name, None


class WeightSink:
    """Fills a model's parameters from named tensors; ``finish`` checks that nothing is missing."""

    def __init__(self, model: CausalLM, source: str) -> None:
        self.model = model
        self.source = source  # names the checkpoint in error messages
        self.params = dict(model.named_parameters())
        self.device = next(iter(self.params.values())).device
        self._rows: dict[str, int] = {}  # parameter -> number of rows filled

    def wanted(self, name: str) -> bool:
        """False for checkpoint tensors the model does not keep (rotary caches, a tied lm_head)."""
        return "rotary_emb" not in name and not (name == "lm_head.weight" and self.model.lm_head is None)

    @torch.no_grad()
    def put(self, name: str, tensor: torch.Tensor, where: str = "") -> None:
        """Copy ``tensor`` (any dtype or device) into the parameter rows that HF name ``name`` fills."""
        where = where or self.source
        target, piece = _target(name)
        param = self.params.get(target)
        if param is None:
            raise ConfigError(
                f"{where}: weight {name!r} has no place in a {self.model.args.model_type} model"
            )
        dest = param if piece is None else param[self._piece_rows(target, piece)]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ConfigError(
                f"{where}: weight {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(dest.shape)}; the checkpoint's config does not match its weights"
            )
        dest.copy_(tensor)
        self._rows[target] = self._rows.get(target, 0) + dest.shape[0]

    def finish(self) -> None:
        missing = [n for n, p in self.params.items() if self._rows.get(n, 0) != p.shape[0]]
        if missing:
            raise ConfigError(f"{self.source}: weights missing from the checkpoint: {', '.join(missing[:5])}")

    def _piece_rows(self, param_name: str, piece: int) -> slice:
        args = self.model.args
        sizes = (
            [args.q_size, args.kv_size, args.kv_size]
            if "qkv_proj" in param_name
            else [args.intermediate_size, args.intermediate_size]
        )
        start = sum(sizes[:piece])
        return slice(start, start + sizes[piece])
