"""Host-side inputs of a decode step, shared by the eager runner and the CUDA-graph replayer."""

from __future__ import annotations

import dataclasses

import numpy as np

from moriio_ray.engine.sequence import Sequence


@dataclasses.dataclass
class DecodeInputs:
    """Host-side inputs of a decode step, one row per sequence (int64 numpy arrays)."""

    ids: np.ndarray  # [B] the token fed (each sequence's last)
    positions: np.ndarray  # [B] its position (== the number of tokens already cached)
    block_tables: np.ndarray  # [B, width] block ids, padded with ``pad_block``
    slot_blocks: np.ndarray  # [B] the block its K/V go to
    slot_offsets: np.ndarray  # [B] the offset inside that block


def decode_inputs(
    seqs: list[Sequence], block_size: int, width: int | None = None, pad_block: int = 0
) -> DecodeInputs:
    """Decode inputs for ``seqs``; ``width`` block-table columns (default: the longest table)."""
    ids = np.fromiter(
        (seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1] for seq in seqs),
        dtype=np.int64,
        count=len(seqs),
    )
    positions = np.fromiter((seq.num_cached for seq in seqs), dtype=np.int64, count=len(seqs))
    width = width if width is not None else max(len(seq.block_table) for seq in seqs)
    tables = np.full((len(seqs), width), pad_block, dtype=np.int64)  # padding is masked out
    for i, seq in enumerate(seqs):
        tables[i, : len(seq.block_table)] = seq.block_table
    blocks = tables[np.arange(len(seqs)), positions // block_size]
    return DecodeInputs(ids, positions, tables, blocks, positions % block_size)
