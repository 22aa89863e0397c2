"""Descriptors: pickle for Ray, msgpack bytes, schema version and epoch checks at connect."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from moriio_ray.config import TransferConfig
from moriio_ray.errors import IncompatiblePeer, StaleDescriptor
from moriio_ray.transfer import (
    EngineDesc,
    KVLayout,
    MemoryDesc,
    Transfer,
    TransferAgent,
    decode_engine_desc,
    decode_memory_desc,
    encode_desc,
)
from moriio_ray.transfer.desc import SCHEMA_VERSION

pytestmark = pytest.mark.timeout(30)

ENGINE = EngineDesc(
    key="prefill-0",
    backend="tcp",
    host="10.0.0.7",
    pid=4242,
    epoch=3,
    node_id="node-a",
    backend_data=b"\x81\xa4port\xcd\x1f\x90",
)
MEMORY = MemoryDesc(
    engine_key="prefill-0", epoch=3, mem_id=2, num_bytes=1 << 30, device="cuda:1", backend_data=b"\0\1"
)


@pytest.mark.parametrize("desc", [ENGINE, MEMORY], ids=["engine", "memory"])
def test_pickle_round_trip(desc: EngineDesc | MemoryDesc) -> None:
    again = pickle.loads(pickle.dumps(desc))
    assert again == desc and type(again) is type(desc)


def test_msgpack_round_trip() -> None:
    assert decode_engine_desc(encode_desc(ENGINE)) == ENGINE
    assert decode_memory_desc(encode_desc(MEMORY)) == MEMORY
    assert isinstance(encode_desc(ENGINE), bytes)
    with pytest.raises(msgspec.ValidationError):
        decode_memory_desc(encode_desc(ENGINE))  # an engine descriptor is not a memory descriptor


def test_schema_version_travels_and_defaults_to_current() -> None:
    assert ENGINE.schema_version == MEMORY.schema_version == SCHEMA_VERSION
    future = msgspec.structs.replace(ENGINE, schema_version=SCHEMA_VERSION + 1)
    assert decode_engine_desc(encode_desc(future)).schema_version == SCHEMA_VERSION + 1


def test_layout_round_trips() -> None:
    lay = KVLayout(
        num_layers=2, num_blocks=8, block_size=16, num_kv_heads=4, head_dim=64, order="block_major"
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(lay), type=KVLayout) == lay
    assert pickle.loads(pickle.dumps(lay)) == lay


class FakeAgent(TransferAgent):
    """A fake agent for these tests only: it connects to anything and cannot move data."""

    name = "tcp"

    def _transfer(self, *args: object) -> Transfer:
        raise NotImplementedError("the fake agent moves no data")


def test_connect_checks_schema_backend_and_epoch() -> None:
    agent = FakeAgent(TransferConfig(backend="tcp"), "decode-0")
    with pytest.raises(IncompatiblePeer, match="schema 2, this agent 1"):
        agent.connect(msgspec.structs.replace(ENGINE, schema_version=2))
    with pytest.raises(IncompatiblePeer, match="uses backend 'shm', this agent 'tcp'"):
        agent.connect(msgspec.structs.replace(ENGINE, backend="shm"))
    agent.connect(ENGINE)
    agent.connect(ENGINE)  # idempotent
    with pytest.raises(StaleDescriptor, match="epoch 2 is older than the connected epoch 3"):
        agent.connect(msgspec.structs.replace(ENGINE, epoch=2))
    newer = msgspec.structs.replace(ENGINE, epoch=4)
    agent.connect(newer)
    assert agent.peers()["prefill-0"] == newer
