"""The built-in engine: a Llama/Qwen-family decoder over a paged KV cache with continuous batching.

Names load lazily, so importing ``SamplingParams`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "Engine": "moriio_ray.engine.engine",
    "ROLES": "moriio_ray.engine.engine",
    "StepOutput": "moriio_ray.engine.outputs",
    "PrefillResult": "moriio_ray.engine.outputs",
    "SamplingParams": "moriio_ray.engine.sampling",
    "BlockAllocator": "moriio_ray.engine.block_allocator",
    "Tokenizer": "moriio_ray.engine.tokenizer",
    "load_tokenizer": "moriio_ray.engine.tokenizer",
    "PRESET_TABLE": "moriio_ray.engine.presets",
}

__all__ = [
    "PRESET_TABLE",
    "ROLES",
    "BlockAllocator",
    "Engine",
    "PrefillResult",
    "SamplingParams",
    "StepOutput",
    "Tokenizer",
    "load_tokenizer",
]
assert sorted(__all__) == sorted(_EXPORTS)

if TYPE_CHECKING:
    from moriio_ray.engine.block_allocator import BlockAllocator
    from moriio_ray.engine.engine import ROLES, Engine
    from moriio_ray.engine.outputs import PrefillResult, StepOutput
    from moriio_ray.engine.presets import PRESET_TABLE
    from moriio_ray.engine.sampling import SamplingParams
    from moriio_ray.engine.tokenizer import Tokenizer, load_tokenizer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moriio_ray.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
