"""WRITE under chunked prefill, without Ray: a prompt prefilled chunk by chunk is pushed chunk by
chunk, and D's blocks end up with exactly P's KV. Each block goes once per layer, whole, after its
last token was computed (a block pushed early would carry stale slots: P's blocks start as garbage
here and fill in as the "forward pass" goes)."""

from __future__ import annotations

import pytest
import torch

from moriio_ray.engine.batch import PrefillChunk
from moriio_ray.worker.push import LayerPusher, push_targets
from tests.unit.test_tp_transfer import Rank

pytestmark = pytest.mark.timeout(60)

BLOCK = 16
LOCAL, DEST = [3, 5, 7], [10, 2, 6]  # no two neighbours: every (layer, K/V, block) is one segment


@pytest.mark.parametrize("chunk", [37, 10, 16, 5])
def test_a_chunked_push_lands_the_final_kv_once_per_block_and_layer(chunk: int) -> None:
    p, d = Rank("p", 0, 1), Rank("d", 0, 1)
    try:
        p.agent.connect(d.agent.engine_desc())
        num_tokens, num_layers = 37, p.layout.num_layers  # 3 blocks, the last one partial
        p.tensor[:, :, LOCAL] = -1.0  # garbage until "computed"
        pusher = LayerPusher(p.agent, p.mem, p.layout, push_targets(p.layout, [d.desc]), DEST)
        for start in range(0, num_tokens, chunk):
            end = min(start + chunk, num_tokens)
            step = PrefillChunk("r", start, end, num_tokens)
            for layer in range(num_layers):
                for t in range(start, end):  # this layer's K/V of the chunk's tokens
                    p.tensor[layer, :, LOCAL[t // BLOCK], t % BLOCK] = 1000.0 * layer + t + 0.5
                pusher.on_layer(layer, step, LOCAL)
        pusher.wait_all(10)
        assert pusher.num_segments == num_layers * 2 * len(LOCAL)  # each block once per layer
        assert pusher.complete.is_set()
        got = d.tensor[:, :, DEST].flatten(2, 3)[:, :, :num_tokens]  # [layers, 2, tokens, heads, dim]
        want = p.tensor[:, :, LOCAL].flatten(2, 3)[:, :, :num_tokens]
        assert (want > 0).all() and torch.equal(got, want)
    finally:
        p.agent.close()
        d.agent.close()


def test_ready_blocks_complete_each_block_once() -> None:
    # [start, end) of a 37-token prompt in blocks of 16 -> the blocks that chunk completes
    assert PrefillChunk("r", 0, 10, 37).ready_blocks(BLOCK) == (0, 0)
    assert PrefillChunk("r", 10, 20, 37).ready_blocks(BLOCK) == (0, 1)
    assert PrefillChunk("r", 20, 32, 37).ready_blocks(BLOCK) == (1, 2)
    assert PrefillChunk("r", 32, 37, 37).ready_blocks(BLOCK) == (2, 3)  # the partial last block
    assert PrefillChunk("r", 0, 37, 37).ready_blocks(BLOCK) == (0, 3)
    assert PrefillChunk("r", 16, 32, 32).ready_blocks(BLOCK) == (1, 2)


@pytest.mark.parametrize(("d_held", "p_cached"), [(0, 2), (1, 2), (2, 1), (2, 0), (1, 1)])
@pytest.mark.parametrize("chunk", [37, 10])
def test_a_push_skips_the_blocks_d_holds_and_sends_those_p_found_cached(
    d_held: int, p_cached: int, chunk: int
) -> None:
    """Prefix caching: D's reservation holds its first ``d_held`` blocks already (never written);
    P found its first ``p_cached`` blocks in its cache (computed earlier, never by a chunk here):
    every block from ``d_held`` on lands once per layer, P's cached ones with the first chunk."""
    p, d = Rank("p", 0, 1), Rank("d", 0, 1)
    try:
        p.agent.connect(d.agent.engine_desc())
        num_tokens, num_layers = 37, p.layout.num_layers
        p.tensor[:, :, LOCAL] = -1.0
        d.tensor[:, :, DEST] = -7.0  # what D holds (its cached blocks keep it)
        for layer in range(num_layers):  # P's cached blocks: computed by an earlier request
            for t in range(p_cached * BLOCK):
                p.tensor[layer, :, LOCAL[t // BLOCK], t % BLOCK] = 1000.0 * layer + t + 0.5
        pusher = LayerPusher(p.agent, p.mem, p.layout, push_targets(p.layout, [d.desc]), DEST, None, d_held)
        for start in range(p_cached * BLOCK, num_tokens, chunk):
            end = min(start + chunk, num_tokens)
            step = PrefillChunk("r", start, end, num_tokens)
            for layer in range(num_layers):
                for t in range(start, end):
                    p.tensor[layer, :, LOCAL[t // BLOCK], t % BLOCK] = 1000.0 * layer + t + 0.5
                pusher.on_layer(layer, step, LOCAL)
        pusher.wait_all(10)
        assert pusher.num_segments == num_layers * 2 * (len(LOCAL) - d_held)
        got = d.tensor[:, :, DEST].flatten(2, 3)[:, :, d_held * BLOCK : num_tokens]
        want = p.tensor[:, :, LOCAL].flatten(2, 3)[:, :, d_held * BLOCK : num_tokens]
        assert (want > 0).all() and torch.equal(got, want)
        assert bool((d.tensor[:, :, DEST[:d_held]] == -7.0).all())
    finally:
        p.agent.close()
        d.agent.close()
