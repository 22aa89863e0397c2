"""Multi-node: a head and two worker nodes (ray.cluster_utils.Cluster), each with its own label.

SPREAD with label selectors puts P and D on different nodes; the pipeline over tcp gives the
colocated tokens; removing the decode worker's node behaves as a decode-worker death does, and a
new node with the label takes the replacement.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from moriio_ray import PDPipeline, SamplingParams
from moriio_ray.errors import PeerLost
from tests.integration.helpers import leaks, tiny_config, varied_prompts, wait_until
from tests.integration.reference import colocated_tokens

LABEL = "moriio.test/pool"
FAST_FAILURE = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "_system_config": FAST_FAILURE},
    )
    c.add_node(num_cpus=1, labels={LABEL: "prefill"})
    c.add_node(num_cpus=1, labels={LABEL: "decode"})
    ray.init(address=c.address, namespace="moriio_ray", logging_level="WARNING", log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _spread_config(name: str) -> Any:
    base = tiny_config(
        name,
        backend="tcp",
        transfer={"on_transfer_failure": "fail"},
        runtime={"worker_start_timeout_s": 60.0},
    )
    import msgspec

    pool = msgspec.structs.replace(
        base.pool,
        placement_strategy="SPREAD",
        prefill=msgspec.structs.replace(base.pool.prefill, labels={LABEL: "prefill"}),
        decode=msgspec.structs.replace(base.pool.decode, labels={LABEL: "decode"}),
    )
    return msgspec.structs.replace(base, pool=pool)


def _node_of(pipe: PDPipeline, key: str) -> str:
    member = ray.get(pipe.coordinator.lookup.remote(key))
    return str(member.node_id)


@pytest.mark.timeout(240)
def test_spread_tcp_pipeline_and_node_loss(cluster: Cluster) -> None:
    name = "multinode"
    prompts = varied_prompts(8, seed=21)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    expected = colocated_tokens(prompts, params)
    pipe = PDPipeline.launch(_spread_config(name))
    try:
        p_node, d_node = _node_of(pipe, f"{name}-prefill-0"), _node_of(pipe, f"{name}-decode-0")
        labels = {n["NodeID"]: n.get("Labels", {}).get(LABEL) for n in ray.nodes() if n["Alive"]}
        assert p_node != d_node
        # the coordinator sits on the launching node (the head), which outlives the worker nodes
        assert pipe.stats()["coordinator_node"] == ray.get_runtime_context().get_node_id()
        assert labels[p_node] == "prefill" and labels[d_node] == "decode"

        results = pipe.generate_batch(prompts, params, max_concurrency=8)
        assert [r.token_ids for r in results] == expected

        # Remove the decode worker's node mid-stream.
        d_ray_node = next(n for n in cluster.worker_nodes if n.node_id == d_node)
        long = SamplingParams(max_tokens=400, ignore_eos=True)

        async def run() -> list[Any]:
            started = asyncio.Event()
            outcomes: list[Any] = []

            async def one(ids: list[int]) -> None:
                n = 0
                try:
                    async for ev in pipe.stream(token_ids=ids, params=long):
                        n += len(ev.token_ids)
                        if n >= 5:
                            started.set()
                    outcomes.append(("done", n))
                except Exception as exc:
                    outcomes.append((exc, n))

            tasks = [asyncio.ensure_future(one(p)) for p in prompts[:4]]
            await asyncio.wait_for(started.wait(), 60)
            await asyncio.to_thread(cluster.remove_node, d_ray_node)
            # every stream ends once the node is gone (bounded; the tight bound is test_failures')
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return outcomes

        outcomes = pipe._sync(run())
        for outcome, n in outcomes:
            assert isinstance(outcome, PeerLost) or (outcome == "done" and n == 400), (outcome, n)
        assert any(isinstance(o, PeerLost) for o, _n in outcomes)

        # A fresh node with the decode label takes the replacement, which then serves.
        cluster.add_node(num_cpus=1, labels={LABEL: "decode"})
        wait_until(
            lambda: (
                (m := ray.get(pipe.coordinator.lookup.remote(f"{name}-decode-0"))) is not None
                and m.epoch == 2
            ),
            90,
            "the replacement decode worker on the new node",
        )
        wait_until(
            lambda: (m := pipe.router.membership.find(f"{name}-decode-0")) is not None and m.epoch == 2,
            10,
            "the router to see the replacement",
        )
        again = pipe.generate_batch(prompts[:2], params, max_concurrency=2)
        assert [r.token_ids for r in again] == expected[:2]
        wait_until(lambda: not leaks(pipe.stats()), 15, "no leaked blocks on any engine")
    finally:
        pipe.shutdown()
