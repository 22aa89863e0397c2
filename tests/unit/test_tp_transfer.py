"""Transfers between tensor-parallel engines without Ray: real shm agents, one per rank.

- Rank 0 connects only to the peer ranks that share its KV heads; another rank connects lazily.
- A peer engine lost mid-transfer: rank 0's directory drops every rank of it and tells this
  engine's other ranks, whose in-flight reads then fail with PeerLost.
- A push waits until the last layer is pushed (a rank may run its forward pass behind rank 0).
- Engine groups: one bundle of every rank's resources; more GPUs than a node holds is a ConfigError.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from moriio_ray.config import PoolConfig, RoleConfig, TransferConfig
from moriio_ray.coordinator.engine_group import bundle, check_node_fit
from moriio_ray.engine.batch import PrefillChunk
from moriio_ray.errors import ConfigError, PeerLost, TransferTimeout
from moriio_ray.protocol.messages import Member, RankDesc, Role, WorkerInfo
from moriio_ray.transfer import TransferAgent, create_agent
from moriio_ray.transfer.layout import KVLayout
from moriio_ray.worker.peers import PeerDirectory
from moriio_ray.worker.push import LayerPusher, push_targets
from moriio_ray.worker.tp_transfer import issue_reads, plan_pulls
from tests.contract.hooks import HoldingShmAgent

pytestmark = pytest.mark.timeout(60)

HEADS, NUM_BLOCKS = 2, 128
WHOLE = PrefillChunk("r", 0, 32, 32)  # a two-block prompt (blocks of 16) in one chunk


def layout(rank: int, tp: int) -> KVLayout:
    per = HEADS // tp
    return KVLayout(
        num_layers=2, num_blocks=NUM_BLOCKS, block_size=16, num_kv_heads=per, head_dim=64, dtype="float32",
        kv_head_start=rank * per, total_kv_heads=HEADS,
    )  # fmt: skip


class Rank:
    """One rank: an agent with its KV shard registered."""

    def __init__(self, key: str, rank: int, tp: int, agent_cls: type[TransferAgent] | None = None) -> None:
        config = TransferConfig(backend="shm")
        self.agent = agent_cls(config, key) if agent_cls is not None else create_agent(config, key)
        self.layout = layout(rank, tp)
        self.tensor = self.agent.allocate(self.layout.shape, torch.float32, "cpu")
        self.tensor.view(-1).copy_(torch.arange(self.tensor.numel(), dtype=torch.float32) + 1000 * rank)
        self.mem = self.agent.register(self.tensor)
        self.desc = RankDesc(
            rank=rank, engine_desc=self.agent.engine_desc(), kv_mem=self.mem, layout=self.layout
        )


@pytest.fixture
def engines() -> Iterator[dict[str, list[Rank]]]:
    p = [Rank("p", 0, 2), Rank("p.rank1", 1, 2)]
    d = [Rank("d", 0, 2), Rank("d.rank1", 1, 2, HoldingShmAgent)]
    yield {"p": p, "d": d}
    for r in (*p, *d):
        r.agent.close()


class Coordinator:
    """What a PeerDirectory asks the coordinator: ``lookup.remote(key)``."""

    def __init__(self, members: dict[str, Member]) -> None:
        self.members = members
        self.lookup = self

    def remote(self, key: str) -> Any:
        async def answer() -> Member | None:
            return self.members.get(key)

        return answer()


def member_of(ranks: list[Rank], key: str) -> Member:
    r0 = ranks[0]
    info = WorkerInfo(
        key=key, role=Role.PREFILL, epoch=1, engine_desc=r0.desc.engine_desc, kv_mem=r0.mem, layout=r0.layout,
        max_model_len=64, vocab_size=10, same_host_only=True, ranks=[r.desc for r in ranks],
    )  # fmt: skip

    return Member.of(info, role="prefill", epoch=1, actor=None, actor_name=f"worker:{key}:1")


def test_a_lost_peer_fails_the_other_ranks_reads_with_peer_lost(engines: dict[str, list[Rank]]) -> None:
    p, d = engines["p"], engines["d"]
    forwarded: list[list[str]] = []

    def on_lost(keys: list[str]) -> None:  # what RankGroup.lost has each other rank do
        forwarded.append(keys)
        for key in keys:
            d[1].agent.disconnect(key)

    directory = PeerDirectory(d[0].agent, Coordinator({"p": member_of(p, "p")}), 5.0, d[0].layout, on_lost)
    peer = asyncio.run(directory.get("p", 1))
    assert set(d[0].agent.peers()) == {"p"}  # rank 0 shares heads with P's rank 0 only
    blocks = np.arange(100)  # 2 layers x K/V x 100 blocks x 4 KiB: past shm's inline size
    pulls = plan_pulls([r.desc for r in d], peer.info.rank_descs(), blocks, blocks)
    assert [(rank, [i.peer.key for i in items]) for rank, items in sorted(pulls.items())] == [
        (0, ["p"]),
        (1, ["p.rank1"]),
    ]
    held, release = d[1].agent.hold_after(1)  # type: ignore[attr-defined]
    (xfer,) = issue_reads(d[1].agent, d[1].mem, pulls[1])
    assert set(d[1].agent.peers()) == {"p.rank1"}  # connected on first use
    assert held.wait(10), "the read did not start"
    directory.lost("p", 1)  # the coordinator saw the P engine die (one of its ranks)
    release.set()
    assert forwarded == [["p", "p.rank1"]]
    with pytest.raises(PeerLost):
        xfer.wait(10)
    assert d[0].agent.peers() == {} and d[1].agent.peers() == {}


def test_rank_reads_move_their_heads(engines: dict[str, list[Rank]]) -> None:
    p, d = engines["p"], engines["d"]
    blocks = [5, 6, 9]
    pulls = plan_pulls([r.desc for r in d], [r.desc for r in p], blocks, [1, 2, 3])
    for rank, items in pulls.items():
        for xfer in issue_reads(d[rank].agent, d[rank].mem, items):
            xfer.wait(10)
        assert torch.equal(d[rank].tensor[:, :, blocks], p[rank].tensor[:, :, [1, 2, 3]])


def test_a_push_waits_for_the_last_layer(engines: dict[str, list[Rank]]) -> None:
    p, d = engines["p"], engines["d"]
    targets = push_targets(p[1].layout, [r.desc for r in d])
    assert [t.rank for t in targets] == [1]
    p[1].agent.connect(targets[0].engine_desc)  # as RankWorker.prepare_push does
    pusher = LayerPusher(p[1].agent, p[1].mem, p[1].layout, targets, [7, 8])
    pusher.on_layer(0, WHOLE, [3, 4])
    with pytest.raises(TransferTimeout, match="pushed 1 of 2 layers"):
        pusher.wait_all(0.2)
    later = threading.Timer(0.2, pusher.on_layer, (1, WHOLE, [3, 4]))
    later.start()
    pusher.wait_all(10)  # returns once layer 1 is pushed and landed
    later.join()
    assert torch.equal(d[1].tensor[:, :, [7, 8]], p[1].tensor[:, :, [3, 4]])


def test_an_engine_group_is_one_bundle_on_one_node() -> None:
    rc = RoleConfig(tensor_parallel_size=4, num_gpus=1, num_cpus=2, resources={"rack_a": 1})
    assert bundle(rc) == {"CPU": 8, "GPU": 4, "rack_a": 4}
    assert bundle(RoleConfig(num_cpus=0)) == {"CPU": 0.01}
    pool = PoolConfig(decode=RoleConfig(tensor_parallel_size=4, num_gpus=1))
    nodes = [{"Alive": True, "Resources": {"GPU": 2.0}}, {"Alive": True, "Resources": {"GPU": 4.0}}]
    check_node_fit(pool, nodes)
    with pytest.raises(
        ConfigError, match=r"pool\.decode\.tensor_parallel_size: 4 ranks of 1 GPU need 4 GPUs"
    ):
        check_node_fit(pool, [*nodes[:1], {"Alive": False, "Resources": {"GPU": 8.0}}])
    check_node_fit(PoolConfig(decode=RoleConfig(tensor_parallel_size=4)), nodes[:1])  # CPU ranks


def test_a_preset_that_does_not_split_into_the_tp_size_is_refused_before_any_worker_starts() -> None:
    from moriio_ray.config_load import parse_pipeline_config
    from moriio_ray.coordinator.engine_group import check_tp_sizes

    ok = parse_pipeline_config({"pool": {"decode": {"tensor_parallel_size": 2}}})
    check_tp_sizes(ok)
    bad = parse_pipeline_config({"pool": {"prefill": {"tensor_parallel_size": 4}}})  # tiny: 2 KV heads
    with pytest.raises(ConfigError, match=r"^pool\.prefill\.tensor_parallel_size: 4 does not divide"):
        check_tp_sizes(bad)
