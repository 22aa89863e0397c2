"""Property-based descriptor decoding: any bytes decode to a descriptor or raise msgspec's
DecodeError, never anything else; every descriptor survives a round trip; a corrupted encoding
is refused or decodes to a well-typed descriptor (the transfer layer then checks bounds and epochs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moriio_ray.protocol.messages import OutputBatch, RequestOutput
from moriio_ray.transfer.desc import (
    EngineDesc,
    MemoryDesc,
    decode_engine_desc,
    decode_memory_desc,
    encode_desc,
)
from moriio_ray.transfer.layout import BLOCK_MAJOR, DTYPE_BYTES, LAYER_MAJOR, KVLayout

FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
i64 = st.integers(-(2**63), 2**63 - 1)
u64 = st.integers(0, 2**64 - 1)
text = st.text(max_size=24)

engine_descs = st.builds(
    EngineDesc,
    key=text,
    backend=st.sampled_from(["tcp", "shm", "cuda_ipc", "mori"]) | text,
    host=text,
    pid=i64,
    epoch=i64,
    node_id=text,
    machine_id=text,
    backend_data=st.binary(max_size=64),
    schema_version=i64,
)
memory_descs = st.builds(
    MemoryDesc,
    engine_key=text,
    epoch=i64,
    mem_id=i64,
    num_bytes=u64,
    device=st.sampled_from(["cpu", "cuda:0"]) | text,
    backend_data=st.binary(max_size=64),
    schema_version=i64,
)
layouts = st.builds(
    KVLayout,
    num_layers=st.integers(1, 128),
    num_blocks=st.integers(1, 1 << 20),
    block_size=st.integers(1, 256),
    num_kv_heads=st.integers(1, 64),
    head_dim=st.integers(1, 512),
    dtype=st.sampled_from(sorted(DTYPE_BYTES)),
    order=st.sampled_from([LAYER_MAJOR, BLOCK_MAJOR]),
)
DECODERS: dict[str, tuple[Callable[[bytes], Any], type]] = {
    "engine": (decode_engine_desc, EngineDesc),
    "memory": (decode_memory_desc, MemoryDesc),
    "layout": (msgspec.msgpack.Decoder(KVLayout).decode, KVLayout),
    "outputs": (msgspec.msgpack.Decoder(OutputBatch).decode, OutputBatch),  # a worker's stream item
}


def _decode_or_refuse(name: str, data: bytes) -> Any:
    """Decode ``data``; a refusal must be msgspec's DecodeError (ValidationError is one)."""
    decode, cls = DECODERS[name]
    try:
        value = decode(data)
    except msgspec.DecodeError:
        return None
    assert isinstance(value, cls)
    # a decoded descriptor is well typed: re-encoding it gives bytes that decode to it again
    assert decode(msgspec.msgpack.encode(value)) == value
    return value


@pytest.mark.timeout(60)
@FUZZ
@given(st.one_of(engine_descs, memory_descs))
def test_descriptors_round_trip(desc: EngineDesc | MemoryDesc) -> None:
    decode = decode_engine_desc if isinstance(desc, EngineDesc) else decode_memory_desc
    assert decode(encode_desc(desc)) == desc


@pytest.mark.timeout(60)
@FUZZ
@given(st.sampled_from(sorted(DECODERS)), st.binary(max_size=200))
def test_any_bytes_decode_or_are_refused(name: str, data: bytes) -> None:
    _decode_or_refuse(name, data)


@pytest.mark.timeout(60)
@FUZZ
@given(
    st.one_of(
        engine_descs.map(lambda d: ("engine", encode_desc(d))),
        memory_descs.map(lambda d: ("memory", encode_desc(d))),
        layouts.map(lambda d: ("layout", msgspec.msgpack.encode(d))),
    ),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    st.integers(0, 10_000),
)
def test_corrupted_encodings_are_refused_or_well_typed(
    case: tuple[str, bytes], flips: list[tuple[int, int]], cut: int
) -> None:
    name, data = case
    buf = bytearray(data)
    for pos, byte in flips:
        buf[pos % len(buf)] = byte
    _decode_or_refuse(name, bytes(buf))
    _decode_or_refuse(name, bytes(buf[: cut % (len(buf) + 1)]))


@pytest.mark.timeout(60)
@FUZZ
@given(st.integers(1, 5000), st.sampled_from([b"\x91", b"\x81\xa1a", b"\xdd\x00\x00\x00\x01"]))
def test_deeply_nested_input_is_refused(depth: int, opener: bytes) -> None:
    for name in ("engine", "memory"):  # the project's decode functions (msgspec alone recurses)
        assert _decode_or_refuse(name, opener * depth + b"\xc0") is None


@pytest.mark.timeout(60)
def test_a_layout_that_breaks_its_rules_is_refused() -> None:
    good = msgspec.structs.asdict(
        KVLayout(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_dim=8)
    )
    for bad in ({"num_blocks": 0}, {"order": "diagonal"}, {"dtype": "float64"}, {"head_dim": -1}):
        assert _decode_or_refuse("layout", msgspec.msgpack.encode({**good, **bad})) is None
    batch = OutputBatch([RequestOutput("r", [1, 2], None, "length")])
    assert _decode_or_refuse("outputs", msgspec.msgpack.encode(batch)) == batch
