"""Transfer agents. ``create_agent`` imports a backend only when it is chosen.

Importing this package loads no backend and no torch: the descriptors, layouts and plans it
re-exports load on first use (``moriio_ray.transfer.EngineDesc`` imports ``transfer.desc`` then).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from moriio_ray.config import BACKENDS, TransferConfig
from moriio_ray.errors import ConfigError

if TYPE_CHECKING:
    from moriio_ray.transfer.base import TransferAgent
    from moriio_ray.transfer.desc import (
        EngineDesc,
        MemoryDesc,
        decode_engine_desc,
        decode_memory_desc,
        encode_desc,
    )
    from moriio_ray.transfer.handle import FutureTransfer, Transfer
    from moriio_ray.transfer.layout import BLOCK_MAJOR, LAYER_MAJOR, KVLayout
    from moriio_ray.transfer.plan import TransferPlan, plan_blocks

# backend name -> "module:Class", imported on first use
_REGISTRY: dict[str, str] = {
    "tcp": "moriio_ray.transfer.tcp:TcpAgent",
    "shm": "moriio_ray.transfer.shm:ShmAgent",
    "cuda_ipc": "moriio_ray.transfer.cuda_ipc:CudaIpcAgent",
    "mori": "moriio_ray.transfer.mori:MoriAgent",
}
assert tuple(_REGISTRY) == BACKENDS

# re-exported name -> the module that defines it, imported on first use
_EXPORTS: dict[str, str] = {
    "TransferAgent": "moriio_ray.transfer.base",
    "EngineDesc": "moriio_ray.transfer.desc",
    "MemoryDesc": "moriio_ray.transfer.desc",
    "decode_engine_desc": "moriio_ray.transfer.desc",
    "decode_memory_desc": "moriio_ray.transfer.desc",
    "encode_desc": "moriio_ray.transfer.desc",
    "FutureTransfer": "moriio_ray.transfer.handle",
    "Transfer": "moriio_ray.transfer.handle",
    "BLOCK_MAJOR": "moriio_ray.transfer.layout",
    "LAYER_MAJOR": "moriio_ray.transfer.layout",
    "KVLayout": "moriio_ray.transfer.layout",
    "TransferPlan": "moriio_ray.transfer.plan",
    "plan_blocks": "moriio_ray.transfer.plan",
}


def agent_class(backend: str) -> type[TransferAgent]:
    """The agent class of a backend, imported now."""
    target = _REGISTRY.get(backend.lower())
    if target is None:
        raise ConfigError(f"transfer.backend: {backend!r} is not one of {', '.join(_REGISTRY)}")
    module_name, _, cls_name = target.partition(":")
    cls: type[TransferAgent] = getattr(importlib.import_module(module_name), cls_name)
    return cls


def create_agent(
    config: TransferConfig, key: str, *, epoch: int = 1, token: bytes | None = None
) -> TransferAgent:
    """Create the agent of ``config.backend`` for the engine ``key``.

    ``epoch`` tells a restarted engine from its predecessor; ``token`` is the cluster token that
    tcp servers require (the coordinator hands it out; by default one per process).
    """
    if not key:
        raise ConfigError("key: an agent needs a non-empty engine key")
    return agent_class(config.backend)(config, key, epoch=epoch, token=token)


def __getattr__(name: str) -> Any:
    try:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value  # imported once: later lookups find it without this hook
    return value


__all__ = [
    "BLOCK_MAJOR",
    "LAYER_MAJOR",
    "EngineDesc",
    "FutureTransfer",
    "KVLayout",
    "MemoryDesc",
    "Transfer",
    "TransferAgent",
    "TransferConfig",
    "TransferPlan",
    "agent_class",
    "create_agent",
    "decode_engine_desc",
    "decode_memory_desc",
    "encode_desc",
    "plan_blocks",
]
assert set(__all__) == {*_EXPORTS, "TransferConfig", "agent_class", "create_agent"}
