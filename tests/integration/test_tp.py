"""Tensor-parallel engines on Ray (CPU, gloo): PD between TP sizes gives exactly the colocated tokens,
and killing one rank of a decode group fails or recomputes its requests, replaces the whole group
and leaks no block.

Each engine's ranks are separate processes; the tiny preset has 2 KV heads, so TP = 2 puts one KV
head on each rank and a (1, 2) or (2, 1) pair moves head-sliced segments. Launches dominate the
time, so the two kill tests reuse the (1, 2) pipelines of the parity tests (READ: two decode
groups, recompute; WRITE: one decode group, fail), each kept until its kill test is done.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from moriio_ray import PDPipeline, SamplingParams
from moriio_ray.errors import PeerLost
from tests.integration.helpers import assert_no_leaks, tiny_config, varied_prompts, wait_until
from tests.integration.reference import colocated_tokens
from tests.integration.test_failures import _run_until

pytestmark = pytest.mark.usefixtures("ray_cpu")

PROMPTS = varied_prompts(16, seed=11)
# prompts sharing prefixes (run one by one): P and D find cached blocks, head-sliced on every rank
_BASE = varied_prompts(6, seed=12)[5] + varied_prompts(6, seed=13)[5]
SHARED = [_BASE[:n] + tail for n, tail in [(len(_BASE), []), (40, [33, 34]), (64, []), (33, [35] * 20)]]
SHARED += [_BASE[: len(_BASE)]]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # tiny: layers x K/V x block_size x KV heads x head_dim x float32


def tp_config(name: str, p: int, d: int, *, decode: int = 1, **kw: Any) -> Any:
    role = {"num_cpus": 0.25}  # per rank: the two kept pipelines and the next one fit in 4 CPUs
    pool = {
        "prefill": {**role, "replicas": 1, "tensor_parallel_size": p},
        "decode": {**role, "replicas": decode, "tensor_parallel_size": d},
    }
    return tiny_config(name, pool=pool, **kw)


def _info(pipe: PDPipeline, key: str) -> Any:
    member = ray.get(pipe.coordinator.lookup.remote(key))
    return None if member is None else (member.epoch, member.info)


# (p, d, mode) -> what the pipeline is launched with; the (1, 2) ones serve a kill test later.
# With P at TP = 2 the longer prompts are prefilled in chunks of up to 40 tokens: every rank runs
# the chunks of the step message, and (WRITE) pushes the blocks each chunk completed.
CHUNKED = {"engine": {"max_num_batched_tokens": 40}}
SPECS: dict[tuple[int, int, str], dict[str, Any]] = {
    (1, 2, "read"): {"decode": 2, "transfer": {"on_transfer_failure": "recompute"}},
    (1, 2, "write"): {"transfer": {"on_transfer_failure": "fail"}},
    (2, 1, "read"): CHUNKED,
    (2, 1, "write"): CHUNKED,
    (2, 2, "read"): CHUNKED,
    (2, 2, "write"): CHUNKED,
}
KILL = {"recompute": (1, 2, "read"), "fail": (1, 2, "write")}


class Pipelines:
    """Launched on first use; closed by the test that uses one last."""

    def __init__(self) -> None:
        self.open: dict[tuple[int, int, str], tuple[str, PDPipeline]] = {}

    def get(self, p: int, d: int, mode: str) -> tuple[str, PDPipeline]:
        key = (p, d, mode)
        if key not in self.open:
            name = f"tp-{p}{d}-{mode}"
            self.open[key] = (name, PDPipeline.launch(tp_config(name, p, d, mode=mode, **SPECS.get(key, {}))))
        return self.open[key]

    def close(self, key: tuple[int, int, str]) -> None:
        entry = self.open.pop(key, None)
        if entry is not None:
            entry[1].shutdown()


@pytest.fixture(scope="module")
def pipelines() -> Iterator[Pipelines]:
    pipes = Pipelines()
    try:
        yield pipes
    finally:
        for key in list(pipes.open):
            pipes.close(key)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return colocated_tokens(PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def shared_reference() -> list[list[int]]:
    return colocated_tokens(SHARED, GREEDY)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["read", "write"])
@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 1), (2, 2)])
def test_pd_between_tp_sizes_gives_the_colocated_tokens(
    pipelines: Pipelines,
    reference: list[list[int]],
    shared_reference: list[list[int]],
    p: int,
    d: int,
    mode: str,
) -> None:
    name, pipe = pipelines.get(p, d, mode)
    try:
        results = pipe.generate_batch(PROMPTS, GREEDY, max_concurrency=16)
        mismatches = [i for i, r in enumerate(results) if r.token_ids != reference[i]]
        assert not mismatches, f"prompts {mismatches} differ from colocated"
        if mode == "read":  # every byte of every KV head of the prompt's blocks, once
            for prompt, r in zip(PROMPTS, results, strict=True):
                assert r.timings.transfer_bytes == -(-len(prompt) // 16) * BLOCK_BYTES
        # the membership entry carries every rank's descriptors and KV-head range
        for role, tp in (("prefill", p), ("decode", d)):
            _, info = _info(pipe, f"{name}-{role}-0")
            assert [list(r.layout.heads) for r in info.rank_descs()] == ([[0, 1]] if tp == 1 else [[0], [1]])
            assert len({r.engine_desc.pid for r in info.rank_descs()}) == tp
        workers = pipe.stats()["workers"].values()
        assert {(w["role"], w["tensor_parallel_size"]) for w in workers} == {("prefill", p), ("decode", d)}
        assert sum(w["transfer_failures"] + w["recomputes"] for w in workers) == 0
        movers = [w for w in workers if w["role"] == ("decode" if mode == "read" else "prefill")]
        assert sum(w["transfers"] for w in movers) == len(PROMPTS)
        assert_no_leaks(pipe)
        # with cached prefixes on both sides (each rank its heads of the same blocks)
        shared = pipe.generate_batch(SHARED, GREEDY, max_concurrency=1)
        assert [r.token_ids for r in shared] == shared_reference
        hits = {"prefill": 0, "decode": 0}
        for w in pipe.stats()["workers"].values():
            hits[w["role"]] += w["prefix_cache"]["num_hit_tokens"]
        assert hits["prefill"] > 0 and hits["decode"] > 0, hits
        assert_no_leaks(pipe)
    finally:
        if (p, d, mode) not in KILL.values():
            pipelines.close((p, d, mode))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("on_failure", ["fail", "recompute"])
def test_killing_one_rank_of_a_decode_group(pipelines: Pipelines, on_failure: str) -> None:
    # recompute: two decode groups, so that a request continues on the other one
    name, pipe = pipelines.get(*KILL[on_failure])
    assert pipe.config.transfer.on_transfer_failure == on_failure
    victim = f"{name}-decode-0"
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    try:
        epoch, info = _info(pipe, victim)
        rank1_pid = info.rank_descs()[1].engine_desc.pid
        out = pipe._sync(_run_until(pipe, params, 6, 3, lambda: os.kill(rank1_pid, signal.SIGKILL)))
        seen = list(out["seen"].values())  # in prompt order
        expected = colocated_tokens([s["ids"] for s in seen], params)  # the prompts _run_until sent
        on_victim = [i for i, s in enumerate(seen) if victim in s["decode"]]
        assert on_victim, "no request was served by the group whose rank was killed"
        for i, s in enumerate(seen):
            if i in on_victim and on_failure == "fail":
                assert isinstance(s["error"], PeerLost), s["error"]
            else:  # recomputed on the other group from the tokens so far: the same tokens
                assert s["error"] is None and s["tokens"] == expected[i], (i, s["error"])
        # the whole group is replaced at a new epoch: new processes for every rank
        wait_until(lambda: (_info(pipe, victim) or (0, None))[0] == epoch + 1, 60, "a replacement group")
        _, new_info = _info(pipe, victim)
        assert rank1_pid not in {r.engine_desc.pid for r in new_info.rank_descs()}
        wait_until(
            lambda: (m := pipe.router.membership.find(victim)) is not None and m.epoch == epoch + 1,
            10,
            "the router to see it",
        )
        results = pipe.generate_batch(varied_prompts(4, seed=3), GREEDY, max_concurrency=1)
        assert any(r.decode_worker == victim for r in results)
        assert_no_leaks(pipe)
    finally:
        pipelines.close(KILL[on_failure])
