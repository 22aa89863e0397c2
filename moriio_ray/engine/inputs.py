"""Host-side inputs of a decode step, shared by the eager runner and the CUDA-graph replayer.

Filled with a handful of vectorised numpy operations per step (no per-row numpy call), into
arrays the caller owns: the graph replayer writes straight into one pinned staging buffer and
uploads it with a single copy.
"""

from __future__ import annotations

import dataclasses
import itertools

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


def fill_decode_inputs(seqs: list[Sequence], block_size: int, out: DecodeInputs, pad_block: int) -> None:
    """Write the inputs of ``seqs`` into rows ``[:len(seqs)]`` of ``out`` (its arrays have at least
    that many rows; table columns past a sequence's blocks get ``pad_block``, which is masked out)."""
    n = len(seqs)
    out.ids[:n] = np.fromiter(
        (seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1] for seq in seqs), np.int64, n
    )
    positions = out.positions[:n]
    positions[:] = np.fromiter((seq.num_cached for seq in seqs), np.int64, n)
    tables = out.block_tables[:n]
    tables.fill(pad_block)
    lens = np.fromiter((len(seq.block_table) for seq in seqs), np.int64, n)
    flat = np.fromiter(
        itertools.chain.from_iterable(seq.block_table for seq in seqs), np.int64, int(lens.sum())
    )
    rows = np.repeat(np.arange(n), lens)
    cols = np.arange(flat.size) - np.repeat(np.cumsum(lens) - lens, lens)
    tables[rows, cols] = flat
    out.slot_blocks[:n] = tables[np.arange(n), positions // block_size]
    out.slot_offsets[:n] = positions % block_size


def decode_inputs(
    seqs: list[Sequence], block_size: int, width: int | None = None, pad_block: int = 0
) -> DecodeInputs:
    """Decode inputs for ``seqs`` in new arrays; ``width`` table columns (default: the longest table)."""
    n = len(seqs)
    width = width if width is not None else max(len(seq.block_table) for seq in seqs)
    out = DecodeInputs(
        np.empty(n, np.int64),
        np.empty(n, np.int64),
        np.empty((n, width), np.int64),
        np.empty(n, np.int64),
        np.empty(n, np.int64),
    )
    fill_decode_inputs(seqs, block_size, out, pad_block)
    return out
