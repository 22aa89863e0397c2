"""The CUDA-graph decode path's bucketing and padded static inputs, checked on CPU without capture:
the padded forward ``DecodeGraphs`` captures gives the eager decode logits for the real rows and
touches no block but the scratch one."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import prompts_for_block_size, tiny_engine

from moriio_ray.engine.batch import Batch
from moriio_ray.engine.cuda_graph import MIN_CONTEXT_SLOTS, DecodeGraphs, batch_buckets
from moriio_ray.engine.sampling import SamplingParams


@pytest.mark.timeout(10)
def test_batch_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


@pytest.mark.timeout(60)
def test_padded_graph_forward_equals_eager_decode() -> None:
    engine = tiny_engine(num_blocks=64, max_model_len=1024)
    scratch = engine.allocator.num_blocks - 1  # stand-in: keep the last block out of the allocator's hands
    engine.allocator.allocate(engine.allocator.num_free)
    engine.allocator.free(list(range(scratch)))
    graphs = DecodeGraphs(
        engine.model,
        engine.cache.layers,
        engine.block_size,
        scratch,
        max_batch=8,
        max_model_len=1024,
        device=torch.device("cpu"),
    )
    for i, prompt in enumerate(prompts_for_block_size(engine.block_size, count=5, seed=6)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()  # the prefill
    for _ in range(3):
        engine.step()
    seqs = list(engine.scheduler.running)
    assert len(seqs) == 5
    for seq in seqs:  # the blocks the next decode writes into must exist, as the scheduler ensures
        if seq.num_cached // engine.block_size == len(seq.block_table):
            seq.block_table += engine.allocator.allocate(1)
    key = graphs._key(seqs)
    assert key == (8, MIN_CONTEXT_SLOTS // engine.block_size)
    before = engine.kv_cache.clone()
    with torch.inference_mode():
        eager = engine.runner.run(Batch.decode(seqs))
        written_by_eager = engine.kv_cache.clone()
        engine.kv_cache.copy_(before)
        graphs._load(seqs, *key)
        padded = graphs._forward(*key)
    torch.testing.assert_close(padded[:5], eager, rtol=1e-5, atol=1e-5)
    # the same cache writes, except in the scratch block (where the three padding rows wrote)
    view = [engine.kv_cache[layer, kv] for layer in range(engine.layout.num_layers) for kv in range(2)]
    assert all(v[scratch].abs().sum() > 0 for v in view)
    for v, w in zip(
        view,
        [written_by_eager[layer, kv] for layer in range(engine.layout.num_layers) for kv in range(2)],
        strict=True,
    ):
        torch.testing.assert_close(v[:scratch], w[:scratch], rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(10)
def test_too_wide_batches_run_eagerly() -> None:
    engine = tiny_engine(num_blocks=64, max_model_len=1024)
    graphs = DecodeGraphs(
        engine.model,
        engine.cache.layers,
        engine.block_size,
        63,
        max_batch=4,
        max_model_len=1024,
        device=torch.device("cpu"),
        max_gather_bytes=1,
    )
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=5))
    engine.step()
    assert graphs._key(list(engine.scheduler.running)) is None
