"""moriio-ray: a Ray-native KV-cache transfer service for prefill/decode disaggregated inference.

The public names load lazily, so ``import moriio_ray`` imports neither Ray, torch nor a backend.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "PDPipeline": "moriio_ray.caller.pipeline",
    "GenerationResult": "moriio_ray.caller.results",
    "SamplingParams": "moriio_ray.engine.sampling",
    "PipelineConfig": "moriio_ray.config",
    "TransferConfig": "moriio_ray.config",
    "load_config": "moriio_ray.config_load",
    "parse_pipeline_config": "moriio_ray.config_load",
    "create_agent": "moriio_ray.transfer",
    "KVLayout": "moriio_ray.transfer.layout",
    "plan_blocks": "moriio_ray.transfer.plan",
}

__all__ = sorted([*_EXPORTS, "__version__"])

if TYPE_CHECKING:
    from moriio_ray.caller.pipeline import PDPipeline
    from moriio_ray.caller.results import GenerationResult
    from moriio_ray.config import PipelineConfig, TransferConfig
    from moriio_ray.config_load import load_config, parse_pipeline_config
    from moriio_ray.engine.sampling import SamplingParams
    from moriio_ray.transfer import create_agent
    from moriio_ray.transfer.layout import KVLayout
    from moriio_ray.transfer.plan import plan_blocks


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moriio_ray' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
