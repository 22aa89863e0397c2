"""Decode-step inputs: the vectorised fill equals a row-by-row reference on random batches."""

from __future__ import annotations

import random

import numpy as np
import pytest

from moriio_ray.engine.inputs import DecodeInputs, decode_inputs, fill_decode_inputs
from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.engine.sequence import Sequence


def _batch(rng: random.Random, n: int, block_size: int) -> list[Sequence]:
    seqs = []
    for i in range(n):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 40))]
        seq = Sequence(f"s{i}", prompt, SamplingParams(), seed=0)
        seq.output_ids = [rng.randrange(1000) for _ in range(rng.randint(0, 20))]
        seq.num_cached = seq.num_tokens - 1
        seq.block_table = rng.sample(range(500), -(-seq.num_tokens // block_size))
        seqs.append(seq)
    return seqs


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(5))
def test_fill_equals_row_by_row_reference(seed: int) -> None:
    rng = random.Random(seed)
    block_size, pad = rng.choice([1, 4, 16]), 777
    seqs = _batch(rng, rng.randint(1, 33), block_size)
    width = max(len(s.block_table) for s in seqs) + rng.randint(0, 3)
    got = decode_inputs(seqs, block_size, width, pad_block=pad)
    for i, seq in enumerate(seqs):
        last = seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1]
        assert got.ids[i] == last and got.positions[i] == seq.num_cached
        row = seq.block_table + [pad] * (width - len(seq.block_table))
        assert got.block_tables[i].tolist() == row
        assert got.slot_blocks[i] == seq.block_table[seq.num_cached // block_size]
        assert got.slot_offsets[i] == seq.num_cached % block_size


@pytest.mark.timeout(30)
def test_fill_writes_only_the_batch_rows_of_larger_buffers() -> None:
    seqs = _batch(random.Random(9), 3, 4)
    width = max(len(s.block_table) for s in seqs)
    out = DecodeInputs(
        *(np.full(8, -1) for _ in range(3)), np.full((8, width), -1), np.full(8, -1), np.full(8, -1)
    )
    fill_decode_inputs(seqs, 4, out, pad_block=5)
    assert (out.ids[3:] == -1).all() and (out.block_tables[3:] == -1).all()
    assert (out.ids[:3] >= 0).all() and (out.slot_offsets[:3] >= 0).all()
