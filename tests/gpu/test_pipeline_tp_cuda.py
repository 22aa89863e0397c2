"""GPU end to end with tensor parallelism: one rank per GPU (NCCL, CUDA graphs per rank, cuda_ipc).

- colocated TP = 2 on two GPUs gives exactly the tokens of colocated TP = 1, and both ranks'
  decode steps replay graphs;
- PD with (P_TP, D_TP) = (2, 2) on four GPUs, READ and WRITE, gives the same tokens.

The tiny preset runs in float32 here, so that the all-reduce's summation order cannot flip a
greedy token (bfloat16 sums in another order round differently).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from moriio_ray.config_load import parse_pipeline_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs Ray")

PROMPT_LENGTHS = [1, 16, 17, 64, 200, 333]


def _config(name: str, mode: str, *, colocated_tp: int = 0, p: int = 1, d: int = 1) -> Any:
    role = {"num_gpus": 1, "num_cpus": 1}
    if colocated_tp:
        pool = {
            "prefill": {"replicas": 0},
            "decode": {"replicas": 0},
            "colocated": {**role, "replicas": 1, "tensor_parallel_size": colocated_tp},
        }
    else:
        pool = {"prefill": {**role, "tensor_parallel_size": p}, "decode": {**role, "tensor_parallel_size": d}}
    return parse_pipeline_config(
        {
            "name": name,
            "model": {"preset": "tiny", "dtype": "float32", "max_model_len": 2048},
            "engine": {"device": "cuda", "num_blocks": 1024, "max_num_seqs": 16},
            "transfer": {"backend": "cuda_ipc", "mode": mode},
            "pool": pool,
        }
    )


def _prompts() -> list[list[int]]:
    return [[(31 * i + 7 * n) % 200 + 32 for i in range(n)] for n in PROMPT_LENGTHS]


def _tokens(config: Any) -> tuple[list[list[int]], dict[str, Any]]:
    from moriio_ray import PDPipeline, SamplingParams

    pipe = PDPipeline.launch(config)
    try:
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        results = pipe.generate_batch(_prompts(), params, max_concurrency=1)
        stats = pipe.stats()["workers"]
        for w in stats.values():
            assert w["num_free_blocks"] == w["num_blocks"] and w["transfer_failures"] == 0
        return [r.token_ids for r in results], stats
    finally:
        pipe.shutdown()


@pytest.fixture(scope="module")
def expected(ray_gpus: None) -> list[list[int]]:
    tokens, _ = _tokens(_config("gpu-tp1-col", "read", colocated_tp=1))
    return tokens


@pytest.mark.gpu(min_gpus=2)
@pytest.mark.timeout(600)
def test_colocated_tp2_on_two_gpus_equals_tp1(expected: list[list[int]]) -> None:
    tokens, stats = _tokens(_config("gpu-tp2-col", "read", colocated_tp=2))
    assert tokens == expected
    (worker,) = stats.values()
    assert worker["tensor_parallel_size"] == 2 and worker["num_graph_replays"] > 0


@pytest.mark.gpu(min_gpus=4)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["read", "write"])
def test_pd_tp2_to_tp2_on_four_gpus_equals_colocated(expected: list[list[int]], mode: str) -> None:
    tokens, stats = _tokens(_config(f"gpu-tp22-{mode}", mode, p=2, d=2))
    assert tokens == expected
    assert {w["tensor_parallel_size"] for w in stats.values()} == {2}
