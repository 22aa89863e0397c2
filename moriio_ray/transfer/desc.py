"""Descriptors: what one agent publishes so that peers can reach it and its registered regions.

msgspec Structs: they pickle for Ray and encode to msgpack bytes. Each carries a schema version
and an epoch, so that a restarted peer is never mistaken for its stale predecessor.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

SCHEMA_VERSION = 1

_DESC = {"frozen": True, "kw_only": True}


class MemoryDesc(msgspec.Struct, **_DESC):  # type: ignore[call-arg]
    """A registered region, as a peer needs it to address the region one-sidedly."""

    engine_key: str
    epoch: int
    mem_id: int
    num_bytes: int
    device: str  # "cpu" or "cuda:N" (the owner's device)
    backend_data: bytes = b""  # backend-specific: shm name, CUDA IPC handle, packed mori MemoryDesc
    schema_version: int = SCHEMA_VERSION


class EngineDesc(msgspec.Struct, **_DESC):  # type: ignore[call-arg]
    """An agent's identity and how to reach it."""

    key: str
    backend: str
    host: str
    pid: int
    epoch: int
    node_id: str = ""
    machine_id: str = ""  # host name + boot id: what same-host backends compare
    backend_data: bytes = b""  # backend-specific: tcp address, packed mori EngineDesc
    schema_version: int = SCHEMA_VERSION


_D = TypeVar("_D", "MemoryDesc", "EngineDesc")


def encode_desc(desc: MemoryDesc | EngineDesc) -> bytes:
    """msgpack bytes of a descriptor."""
    return msgspec.msgpack.encode(desc)


def decode_engine_desc(data: bytes) -> EngineDesc:
    """An EngineDesc from msgpack bytes; msgspec.DecodeError for anything else."""
    return _decode(data, EngineDesc)


def decode_memory_desc(data: bytes) -> MemoryDesc:
    """A MemoryDesc from msgpack bytes; msgspec.DecodeError for anything else."""
    return _decode(data, MemoryDesc)


def _decode(data: bytes, type_: type[_D]) -> _D:
    try:
        return msgspec.msgpack.decode(data, type=type_)
    except RecursionError:  # msgspec skips an unknown field's value recursively: deep nesting
        raise msgspec.DecodeError(f"{type_.__name__}: the data is nested too deeply") from None
