"""Transfer agents. ``create_agent`` imports a backend only when it is chosen."""

from __future__ import annotations

import importlib

from moriio_ray.config import BACKENDS, TransferConfig
from moriio_ray.errors import ConfigError
from moriio_ray.transfer.base import (
    EngineDesc,
    FutureTransfer,
    MemoryDesc,
    Transfer,
    TransferAgent,
    decode_engine_desc,
    decode_memory_desc,
    encode_desc,
)
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
