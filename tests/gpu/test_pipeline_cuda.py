"""GPU end to end: PDPipeline over cuda_ipc gives exactly the colocated greedy tokens, and the decode
worker replays CUDA graphs.

Two topologies: P and D sharing one GPU (``num_gpus: 0.5`` each, two processes, IPC on one
device), and P on one GPU with D on another. Requests run one at a time, so that colocated and
disaggregated engines run the same batch shapes (bf16 kernels are deterministic for a given shape;
a mixed batch could round differently).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
from typing import Any

import pytest

from moriio_ray.config_load import parse_pipeline_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs Ray")

PROMPT_LENGTHS = [1, 16, 17, 64, 200, 333]
TOPOLOGIES = [
    pytest.param(0.5, marks=pytest.mark.gpu(min_gpus=1), id="one-gpu"),
    pytest.param(1.0, marks=pytest.mark.gpu(min_gpus=2), id="two-gpus"),
]


def _config(name: str, preset: str, mode: str, colocated: bool, num_gpus: float) -> Any:
    role = {"num_gpus": num_gpus, "num_cpus": 1}
    pool = (
        {"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "colocated": {**role, "replicas": 1}}
        if colocated
        else {"prefill": role, "decode": role}
    )
    return parse_pipeline_config(
        {
            "name": name,
            "model": {"preset": preset, "dtype": "bfloat16", "max_model_len": 2048},
            "engine": {"device": "cuda", "num_blocks": 2048, "max_num_seqs": 16},
            "transfer": {"backend": "cuda_ipc", "mode": mode},
            "pool": pool,
        }
    )


def _prompts() -> list[list[int]]:
    return [[(31 * i + 7 * n) % 200 + 32 for i in range(n)] for n in PROMPT_LENGTHS]


@pytest.mark.timeout(500)
@pytest.mark.parametrize("num_gpus", TOPOLOGIES)
@pytest.mark.parametrize("preset", ["tiny", "llama-1b"])
def test_cuda_ipc_pd_equals_colocated(ray_gpus: None, preset: str, num_gpus: float) -> None:
    from moriio_ray import PDPipeline, SamplingParams

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    col = PDPipeline.launch(_config(f"gpu-col-{preset}", preset, "read", True, num_gpus))
    try:
        expected = [r.token_ids for r in col.generate_batch(_prompts(), params, max_concurrency=1)]
        (colocated,) = col.stats()["workers"].values()
        assert colocated["num_graph_replays"] > 0, "the colocated worker decoded eagerly"
    finally:
        col.shutdown()
    report: dict[str, Any] = {}
    for mode in ("read", "write"):
        pipe = PDPipeline.launch(_config(f"gpu-{mode}-{preset}", preset, mode, False, num_gpus))
        try:
            results = pipe.generate_batch(_prompts(), params, max_concurrency=1)
            assert [r.token_ids for r in results] == expected, f"{mode}: tokens differ from colocated"
            workers = pipe.stats()["workers"]
            roles = {w["role"]: w for w in workers.values()}
            devices = {role: w["device"] for role, w in roles.items()}
            if num_gpus == 1.0:
                assert devices["prefill"] != devices["decode"], devices  # two GPUs, one each
            else:
                assert devices["prefill"] == devices["decode"], devices  # one GPU, two processes
            # every decode step after the first token replayed a captured graph
            steps = len(_prompts()) * (params.max_tokens - 1)
            assert roles["decode"]["num_graph_replays"] == steps, roles["decode"]
            assert roles["decode"]["num_graphs"] > 0 and roles["prefill"]["num_graphs"] == 0
            for w in workers.values():
                assert w["num_free_blocks"] == w["num_blocks"] and w["transfer_failures"] == 0
            handoff = [(r.timings.handoff_s or 0.0) * 1e3 for r in results]
            report[mode] = {"devices": devices, "handoff_ms_median": statistics.median(handoff)}
        finally:
            pipe.shutdown()
    print(f"GPU PD parity {preset} num_gpus={num_gpus}: {json.dumps(report)}")
