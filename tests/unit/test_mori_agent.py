"""MoriAgent through a FAKE ``mori``: round trips, sessions, descriptors, peers.

The fake (``tests/unit/fake_mori.py``) stands in for ``mori.io`` because there is no AMD hardware
here and the real ``amd-mori`` wheels are cp310/ROCm only. It copies bytes between registered CPU
tensors for real, so the round trips below check the adapter's offsets and directions.
"""

from __future__ import annotations

import pickle

import fake_mori  # tests/unit is on sys.path under pytest (no __init__.py here)
import msgspec
import numpy as np
import pytest
import torch

from moriio_ray.errors import IncompatiblePeer, PeerLost, StaleDescriptor
from moriio_ray.transfer import decode_engine_desc, decode_memory_desc, encode_desc
from moriio_ray.transfer.mori_api import decode_peer_info
from moriio_ray.transfer.plan import TransferPlan


@pytest.fixture
def fabric(monkeypatch):
    return fake_mori.install(monkeypatch)


def _pair(**knobs):
    p, d = fake_mori.make_agent("prefill-0", **knobs), fake_mori.make_agent("decode-0", **knobs)
    d.connect(p.engine_desc())
    p.connect(d.engine_desc())
    return p, d


def _regions(p, d, num_bytes=4096, seed=0):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen)
    dst = torch.zeros(num_bytes, dtype=torch.uint8)
    return src, dst, p.register(src), d.register(dst)


@pytest.mark.timeout(10)
def test_read_round_trip_scatter_gather(fabric):
    p, d = _pair()
    src, dst, p_mem, d_mem = _regions(p, d)
    remote = np.array([3000, 0, 1024, 77], dtype=np.int64)
    local = np.array([0, 500, 2048, 3900], dtype=np.int64)
    sizes = np.array([96, 300, 1000, 150], dtype=np.int64)
    x = d.read(d_mem, p_mem, TransferPlan(local, remote, sizes))
    x.wait(timeout_s=5.0)
    assert x.done() and x.error() is None and x.bytes_moved == int(sizes.sum())
    for lo, ro, n in zip(local, remote, sizes, strict=True):
        assert torch.equal(dst[lo : lo + n], src[ro : ro + n])
    untouched = torch.ones(4096, dtype=torch.bool)
    for lo, n in zip(local, sizes, strict=True):
        untouched[lo : lo + n] = False
    assert not dst[untouched].any()
    # one batch for the whole request, with plain int lists as pybind's vector<size_t> wants
    ((_, _, lo, ro, sz),) = fabric.methods(d.mori_key, "batch_read")
    assert (lo, ro, sz) == (local.tolist(), remote.tolist(), sizes.tolist())


@pytest.mark.timeout(10)
def test_write_round_trip(fabric):
    p, d = _pair()
    src, _, p_mem, _ = _regions(p, d)
    target = torch.zeros(4096, dtype=torch.uint8)
    d_target = d.register(target)
    x = p.write(p_mem, d_target, TransferPlan([0, 2048], [1024, 2048], [512, 2048]))
    x.wait(timeout_s=5.0)
    assert torch.equal(target[1024:1536], src[0:512])
    assert torch.equal(target[2048:4096], src[2048:4096])
    assert not target[:1024].any() and not target[1536:2048].any()
    assert len(fabric.methods(p.mori_key, "batch_write")) == 1


@pytest.mark.timeout(10)
def test_sessions_are_cached_per_region_pair(fabric):
    p, d = _pair()
    _, _, p_mem, d_mem = _regions(p, d)
    other = d.register(torch.zeros(1024, dtype=torch.uint8))
    for _ in range(3):
        d.read(d_mem, p_mem, TransferPlan([0], [0], [64])).wait(5.0)
    assert len(fabric.methods(d.mori_key, "create_session")) == 1
    d.read(other, p_mem, TransferPlan([0], [0], [64])).wait(5.0)
    d.read(other, p_mem, TransferPlan([64], [64], [64])).wait(5.0)
    sessions = fabric.methods(d.mori_key, "create_session")
    assert [(loc.id, rem.id) for loc, rem in sessions] == [(1, 1), (2, 1)]
    assert len(fabric.methods(d.mori_key, "batch_read")) == 5


@pytest.mark.timeout(10)
def test_sessions_are_dropped_with_their_region_or_peer(fabric):
    p, d = _pair()
    _, _, p_mem, d_mem = _regions(p, d)
    d.read(d_mem, p_mem, TransferPlan([0], [0], [64])).wait(5.0)
    d.disconnect(p.key)
    d.connect(p.engine_desc())
    d.read(d_mem, p_mem, TransferPlan([0], [0], [64])).wait(5.0)
    assert len(fabric.methods(d.mori_key, "create_session")) == 2
    d.deregister(d_mem)
    assert fabric.methods(d.mori_key, "deregister_memory")[-1][0].id == 1
    d_mem2 = d.register(torch.zeros(4096, dtype=torch.uint8))
    d.read(d_mem2, p_mem, TransferPlan([0], [0], [64])).wait(5.0)
    assert len(fabric.methods(d.mori_key, "create_session")) == 3


@pytest.mark.timeout(10)
def test_descriptors_carry_mori_packed_bytes_and_round_trip(fabric):
    p, _ = _pair()
    mem = p.register(torch.zeros(256, dtype=torch.uint8))
    (mori_mem,) = fabric.methods(p.mori_key, "register_torch_tensor")
    assert mem.backend_data == mori_mem[0].pack()
    assert fake_mori.MemoryDesc.unpack(mem.backend_data) == mori_mem[0]
    desc = p.engine_desc()
    info = decode_peer_info(desc.key, desc.backend_data)
    assert info.kind == "rdma"
    mori_desc = fake_mori.EngineDesc.unpack(info.engine)
    assert mori_desc.key == p.mori_key
    for packed in (mem, desc):
        assert pickle.loads(pickle.dumps(packed)) == packed
    assert decode_memory_desc(encode_desc(mem)) == mem
    assert decode_engine_desc(encode_desc(desc)) == desc


@pytest.mark.timeout(10)
def test_connect_registers_the_unpacked_engine_once(fabric):
    p, d = _pair()
    d.connect(p.engine_desc())  # idempotent
    (registered,) = fabric.methods(d.mori_key, "register_remote_engine")
    assert isinstance(registered[0], fake_mori.EngineDesc)
    assert registered[0].key == p.mori_key
    d.disconnect(p.key)
    ((gone,),) = fabric.methods(d.mori_key, "deregister_remote_engine")
    assert gone.key == p.mori_key
    assert p.key not in d.peers()


@pytest.mark.timeout(10)
def test_restarted_peer_gets_a_new_mori_engine(fabric):
    p, d = _pair()
    p2 = fake_mori.make_agent("prefill-0", epoch=2)
    d.connect(p2.engine_desc())
    keys = [args[0].key for args in fabric.methods(d.mori_key, "register_remote_engine")]
    assert keys == [p.mori_key, p2.mori_key] and p.mori_key != p2.mori_key
    assert [a[0].key for a in fabric.methods(d.mori_key, "deregister_remote_engine")] == [p.mori_key]
    with pytest.raises(StaleDescriptor):
        d.connect(p.engine_desc())


@pytest.mark.timeout(10)
def test_rdma_reaches_other_hosts_xgmi_does_not(fabric):
    p, d = fake_mori.make_agent("p", backend="rdma"), fake_mori.make_agent("d", backend="rdma")
    d.connect(msgspec.structs.replace(p.engine_desc(), host="10.9.8.7"))
    px, dx = fake_mori.make_agent("px", backend="xgmi"), fake_mori.make_agent("dx", backend="xgmi")
    dx.connect(px.engine_desc())  # same host: fine
    far = msgspec.structs.replace(
        px.engine_desc(), key="px-far", host="10.9.8.7", machine_id="other-host/boot"
    )
    with pytest.raises(IncompatiblePeer, match=r"xgmi reaches only GPUs of this host.*rdma across hosts"):
        dx.connect(far)
    assert "px-far" not in dx.peers()


@pytest.mark.timeout(10)
def test_rdma_and_xgmi_agents_refuse_each_other(fabric):
    p, d = fake_mori.make_agent("p", backend="rdma"), fake_mori.make_agent("d", backend="xgmi")
    with pytest.raises(IncompatiblePeer, match="runs MoRI backend 'rdma', this agent 'xgmi'"):
        d.connect(p.engine_desc())


@pytest.mark.timeout(10)
def test_peer_without_mori_descriptor_is_refused(fabric):
    p, d = _pair()
    bogus = msgspec.structs.replace(p.engine_desc(), key="other", backend_data=b"not msgpack of ours")
    with pytest.raises(IncompatiblePeer, match="carries no MoRI engine"):
        d.connect(bogus)


@pytest.mark.timeout(10)
def test_empty_request_finishes_without_calling_mori(fabric):
    p, d = _pair()
    _, _, p_mem, d_mem = _regions(p, d)
    x = d.read(d_mem, p_mem, TransferPlan([], [], []))
    x.wait(timeout_s=1.0)
    assert x.done() and x.num_segments == 0
    assert not fabric.methods(d.mori_key, "batch_read")


@pytest.mark.timeout(10)
def test_read_after_disconnect_raises_peer_lost(fabric):
    p, d = _pair()
    _, _, p_mem, d_mem = _regions(p, d)
    d.disconnect(p.key)
    with pytest.raises(PeerLost):
        d.read(d_mem, p_mem, TransferPlan([0], [0], [8]))


@pytest.mark.timeout(10)
def test_close_releases_regions_peers_and_engine(fabric):
    p, d = _pair()
    _regions(p, d)
    d.close()
    assert len(fabric.methods(d.mori_key, "deregister_memory")) == 1
    assert len(fabric.methods(d.mori_key, "deregister_remote_engine")) == 1
    with pytest.raises(Exception, match="is closed"):
        d.register(torch.zeros(8, dtype=torch.uint8))
