"""BlockAllocator (reference counts, leases, exact counters) and KV cache allocation through an agent."""

from __future__ import annotations

import pytest
import torch

from moriio_ray.config import EngineConfig, ModelConfig, TransferConfig
from moriio_ray.engine.block_allocator import BlockAllocator
from moriio_ray.engine.engine import Engine
from moriio_ray.engine.kv_cache import DEFAULT_CPU_BLOCKS, KVCache
from moriio_ray.engine.presets import get_preset
from moriio_ray.errors import CapacityError, ConfigError, InvalidRequest
from moriio_ray.transfer.base import TransferAgent


def _counts(a: BlockAllocator) -> tuple[int, int, int]:
    assert a.num_free + a.num_used == a.num_blocks
    return a.num_free, a.num_used, a.num_leased


@pytest.mark.timeout(10)
def test_refcounts_and_counters() -> None:
    a = BlockAllocator(6)
    x = a.allocate(4)
    assert x == [0, 1, 2, 3] and _counts(a) == (2, 4, 0)
    with pytest.raises(CapacityError, match="only 2 are free"):
        a.allocate(3)
    assert a.can_allocate(2) and not a.can_allocate(3)
    a.lease("t", x[:2], deadline_s=10.0)  # blocks 0, 1 now have two references each
    assert _counts(a) == (2, 4, 2) and a.ref_count(0) == 2
    a.lease("u", x[1:3], deadline_s=20.0)  # block 1 held by two leases: counted once
    assert _counts(a) == (2, 4, 3)
    a.free(x)  # the sequence lets go; leased blocks stay
    assert _counts(a) == (3, 3, 3)
    assert a.release("t") and _counts(a) == (4, 2, 2)
    assert not a.release("t")
    with pytest.raises(InvalidRequest):
        a.lease("u", [1], deadline_s=0.0)
    assert a.sweep(now_s=20.5, grace_s=1.0) == []
    assert a.sweep(now_s=21.5, grace_s=1.0) == ["u"] and _counts(a) == (6, 0, 0)
    with pytest.raises(AssertionError):
        a.free([0])


class _RecordingAgent(TransferAgent):
    """FAKE for tests: a TransferAgent that only records allocate/register/deregister (it moves no data)."""

    name = "tcp"

    def __init__(self, flat: bool) -> None:
        super().__init__(TransferConfig(backend="tcp"), "test-agent")
        self.flat, self.calls = flat, []

    def allocate(self, shape, dtype, device):
        self.calls.append(("allocate", tuple(shape), dtype))
        if self.flat:  # a backend that hands out raw bytes
            num_bytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            return torch.zeros(num_bytes, dtype=torch.uint8)
        return super().allocate(shape, dtype, device)

    def _register(self, mem_id, tensor):
        self.calls.append(("register", tensor.data_ptr()))
        return b""

    def _deregister(self, mem_id):
        self.calls.append(("deregister", mem_id))

    def _transfer(self, *args):
        raise NotImplementedError("the recording agent moves no data")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("flat", [False, True])
def test_engine_allocates_its_cache_through_the_agent(flat: bool) -> None:
    agent = _RecordingAgent(flat)
    engine = Engine(
        ModelConfig(preset="tiny", dtype="float32"),
        EngineConfig(device="cpu", num_blocks=10, block_size=8, layout="block_major"),
        role="prefill",
        agent=agent,
    )
    layout = engine.layout
    assert agent.calls[0] == ("allocate", layout.shape, torch.float32)
    assert engine.kv_mem is not None and engine.kv_mem.num_bytes == layout.total_bytes
    assert agent.local_tensor(engine.kv_mem).data_ptr() == engine.kv_cache.data_ptr()
    assert tuple(engine.kv_cache.shape) == layout.shape and engine.kv_cache.dtype == torch.float32
    args = get_preset("tiny").args
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (
        args.num_layers, args.num_kv_heads, args.head_dim,
    )  # fmt: skip
    engine.close()
    assert agent.calls[-1][0] == "deregister"


@pytest.mark.timeout(10)
def test_cache_sizing() -> None:
    args = get_preset("tiny").args
    cpu = torch.device("cpu")
    assert KVCache(args, EngineConfig(device="cpu"), torch.float32, cpu).num_blocks == DEFAULT_CPU_BLOCKS
    assert KVCache(args, EngineConfig(device="cpu", num_blocks=3), torch.float32, cpu).num_blocks == 3

    class _BadAgent(_RecordingAgent):
        """FAKE for tests: returns a region of the wrong size."""

        def allocate(self, shape, dtype, device):
            return torch.zeros(7, dtype=torch.uint8)

    with pytest.raises(ConfigError, match="allocate returned"):
        KVCache(args, EngineConfig(device="cpu", num_blocks=3), torch.float32, cpu, _BadAgent(False))
