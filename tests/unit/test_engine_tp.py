"""A tensor-parallel engine (two processes, gloo) gives exactly the greedy tokens of one rank,
also when it prefills in chunks.

Also: each rank's KV cache holds its KV-head shard (registered with its own agent) with the values
one rank computes for those heads, rank 0 sends one message per step and none per layer, and a
TP size that does not divide the heads is a ConfigError.
"""

from __future__ import annotations

import pytest
import torch
from tp_procs import engine_config, model_config, reference, run_ranks

from moriio_ray.config_load import parse_pipeline_config
from moriio_ray.engine.engine import Engine
from moriio_ray.engine.presets import get_preset
from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.engine.tp import TPGroup, shard_args
from moriio_ray.engine.tp_size import check_tp_size
from moriio_ray.errors import ConfigError

PROMPTS = [[40 + (i * 7 + j) % 80 for j in range(n)] for i, n in enumerate([1, 4, 5, 9, 17, 30])]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("budget", [4096, 16])
def test_tp2_engine_gives_the_tp1_greedy_tokens_and_holds_its_kv_shard(budget: int) -> None:
    """Also with prompts prefilled in chunks (a budget of 16 tokens a step splits the long ones):
    the step message carries each row's chunk, and the tokens are the unchunked ones."""
    ref = reference(PROMPTS, GREEDY, budget=budget)
    assert ref["tokens"] == (reference(PROMPTS, GREEDY)["tokens"] if budget < 4096 else ref["tokens"])
    leader, follower = run_ranks(2, PROMPTS, budget=budget)
    assert leader["tokens"] == ref["tokens"]
    assert all(len(t) == 16 for t in leader["tokens"])
    # one message per step (none per layer); the other rank ran every step
    assert leader["messages"] == leader["steps"] + 1  # + the graph-capture message
    assert follower["steps"] == leader["steps"]
    full = torch.from_numpy(ref["cache"])  # [layers, 2, blocks, bs, heads=2, dim]
    for rank, report in enumerate((leader, follower)):
        cache = torch.from_numpy(report["cache"])
        lay = report["layout"]
        assert (lay.kv_head_start, lay.num_kv_heads, lay.total_kv_heads) == (rank, 1, 2)
        assert report["mem_bytes"] == lay.total_bytes == full.numel() * 4 // 2
        shard = full[..., rank : rank + 1, :]
        # the same values up to float rounding (a narrower matmul and the all-reduce sum in
        # another order), in the same blocks: nothing of the other rank's heads is in it
        assert cache.abs().sum() > 0
        torch.testing.assert_close(cache, shard, rtol=1e-4, atol=1e-5)


def test_tp_sizes_that_do_not_shard_the_model_are_config_errors() -> None:
    args = get_preset("tiny").args  # 4 attention heads, 2 KV heads
    assert check_tp_size(args, 2) == 2
    assert shard_args(args, 2).num_kv_heads == 1
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: 4 does not divide the model's 2 KV heads"):
        check_tp_size(args, 4)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: 3 does not divide .* use one of 1, 2"):
        check_tp_size(args, 3)
    with pytest.raises(ConfigError, match="tensor_parallel_size: 0 must be a positive integer"):
        check_tp_size(args, 0)
    with pytest.raises(ConfigError, match="tensor_parallel_size: 4 does not divide"):
        Engine(model_config(), engine_config(), role="colocated", tp=TPGroup(0, 4))


@pytest.mark.parametrize("value", [0, -1, 1.5])
def test_pool_tensor_parallel_size_must_be_a_positive_integer(value: object) -> None:
    with pytest.raises(ConfigError, match=r"pool\.decode\.tensor_parallel_size"):
        parse_pipeline_config({"pool": {"decode": {"tensor_parallel_size": value}}})
    cfg = parse_pipeline_config({"pool": {"prefill": {"tensor_parallel_size": 2}}})
    assert (cfg.pool.prefill.tensor_parallel_size, cfg.pool.decode.tensor_parallel_size) == (2, 1)


def test_a_tp_rank_takes_a_whole_gpu() -> None:
    with pytest.raises(ConfigError, match=r"pool\.decode\.num_gpus: 0\.5 with tensor_parallel_size 2"):
        parse_pipeline_config({"pool": {"decode": {"tensor_parallel_size": 2, "num_gpus": 0.5}}})
