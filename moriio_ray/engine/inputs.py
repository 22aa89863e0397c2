"""Host-side inputs of a step, built with a handful of vectorised numpy operations (no per-token
Python work) into one int64 buffer, so that a step uploads them with a single copy.

``step_inputs`` covers any batch (decodes and prefill chunks); ``fill_decode_inputs`` writes a pure
decode batch into arrays the caller owns (the CUDA-graph replayer's pinned staging buffer).

A token that the previous step sampled and the host has not read yet (overlapped scheduling) is
fed from the device: its ``src`` entry is its row in that step's sampled tokens (else -1), and its
``ids`` entry a placeholder 0.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from moriio_ray.engine.batch import Batch
from moriio_ray.engine.sequence import Sequence


def last_token(seq: Sequence) -> int:
    """The token a decode feeds when the host knows it (a placeholder 0 when it is pending)."""
    if seq.num_pending:
        return 0
    return seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1]


def fill_tables(seqs: list[Sequence], tables: np.ndarray, pad_block: int) -> None:
    """Each sequence's block table into a row of ``tables`` [>= B, width], padded with ``pad_block``."""
    n = len(seqs)
    tables[:n].fill(pad_block)
    lens = np.fromiter((len(seq.block_table) for seq in seqs), np.int64, n)
    flat = np.fromiter(
        itertools.chain.from_iterable(seq.block_table for seq in seqs), np.int64, int(lens.sum())
    )
    rows = np.repeat(np.arange(n), lens)
    cols = np.arange(flat.size) - np.repeat(np.cumsum(lens) - lens, lens)
    tables[rows, cols] = flat


@dataclasses.dataclass
class StepInputs:
    """One step's host inputs: int64 views of ``buffer``, which holds them back to back."""

    buffer: np.ndarray
    ids: np.ndarray  # [T] the tokens fed (0 where src >= 0)
    src: np.ndarray  # [T] row of the previous step's sampled tokens to feed instead, or -1
    positions: np.ndarray  # [T]
    slot_blocks: np.ndarray  # [T] the block each new token's K/V goes to
    slot_offsets: np.ndarray  # [T] its offset inside that block
    cu_seqlens_q: np.ndarray  # [B + 1] token offsets of the rows
    context_lens: np.ndarray  # [B] cached + new tokens of each row
    block_tables: np.ndarray  # [B, W] block ids, padded with pad_block
    sample_index: np.ndarray  # [R] the last token of each row that samples
    q_lens: list[int]
    start_pos: list[int]  # tokens cached before this step, per row
    num_decodes: int
    decode_widths: list[int]  # blocks of context of each decode row
    from_device: bool  # some token comes from the device


def step_inputs(batch: Batch, block_size: int, pad_block: int = 0) -> StepInputs:
    """The inputs of ``batch`` (before its sequences' ``num_cached`` advance)."""
    seqs, q_lens = batch.seqs, batch.q_lens
    b, t = len(seqs), sum(q_lens)
    starts = [seq.num_cached for seq in seqs]
    width = max(len(seq.block_table) for seq in seqs)
    samples = batch.samples() if batch.fed is None else [False] * b
    r = sum(samples)
    sizes = [t, t, t, t, t, b + 1, b, b * width, r]
    buf = np.empty(sum(sizes), np.int64)
    ids, src, pos, slot_b, slot_o, cu, ctx, tables, sample = np.split(buf, np.cumsum(sizes)[:-1])
    tables = tables.reshape(b, width)
    q = np.asarray(q_lens, np.int64)
    start = np.asarray(starts, np.int64)
    cu[0] = 0
    np.cumsum(q, out=cu[1:])
    ctx[:] = start + q
    row_of = np.repeat(np.arange(b), q)  # [T] the row of each token
    pos[:] = start[row_of] + np.arange(t) - cu[:-1][row_of]
    nd = batch.num_decodes
    if batch.fed is not None:
        ids[:] = np.fromiter(itertools.chain.from_iterable(batch.fed), np.int64, t)
        src.fill(-1)
    else:
        ids[:nd] = np.fromiter((last_token(s) for s in seqs[:nd]), np.int64, nd)
        src[:nd] = np.fromiter((s.pending_row if s.num_pending else -1 for s in seqs[:nd]), np.int64, nd)
        chunks = (seqs[i].tokens(starts[i], q_lens[i]) for i in range(nd, b))
        ids[nd:] = np.fromiter(itertools.chain.from_iterable(chunks), np.int64, t - nd)
        src[nd:] = -1
    fill_tables(seqs, tables, pad_block)
    slot_b[:] = tables[row_of, pos // block_size]
    slot_o[:] = pos % block_size
    sample[:] = cu[1:][np.asarray(samples, bool)] - 1
    decode_widths = [-(-(s + 1) // block_size) for s in starts[:nd]]
    return StepInputs(
        buf, ids, src, pos, slot_b, slot_o, cu, ctx, tables, sample,
        list(q_lens), starts, nd, decode_widths, bool(nd) and bool((src[:nd] >= 0).any()),
    )  # fmt: skip


@dataclasses.dataclass
class DecodeInputs:
    """Host-side inputs of a decode step, one row per sequence (int64 numpy arrays)."""

    ids: np.ndarray  # [B] the token fed (each sequence's last; 0 where src >= 0)
    src: np.ndarray  # [B] its row in the previous step's sampled tokens, or -1
    positions: np.ndarray  # [B] its position (== the number of tokens already cached)
    block_tables: np.ndarray  # [B, width] block ids, padded with ``pad_block``
    slot_blocks: np.ndarray  # [B] the block its K/V go to
    slot_offsets: np.ndarray  # [B] the offset inside that block


def fill_decode_inputs(seqs: list[Sequence], block_size: int, out: DecodeInputs, pad_block: int) -> None:
    """Write the inputs of ``seqs`` into rows ``[:len(seqs)]`` of ``out`` (its arrays have at least
    that many rows; table columns past a sequence's blocks get ``pad_block``, which is masked out)."""
    n = len(seqs)
    out.ids[:n] = np.fromiter((last_token(seq) for seq in seqs), np.int64, n)
    out.src[:n] = np.fromiter((seq.pending_row if seq.num_pending else -1 for seq in seqs), np.int64, n)
    positions = out.positions[:n]
    positions[:] = np.fromiter((seq.num_cached for seq in seqs), np.int64, n)
    tables = out.block_tables[:n]
    fill_tables(seqs, tables, pad_block)
    out.slot_blocks[:n] = tables[np.arange(n), positions // block_size]
    out.slot_offsets[:n] = positions % block_size


def decode_inputs(
    seqs: list[Sequence], block_size: int, width: int | None = None, pad_block: int = 0
) -> DecodeInputs:
    """Decode inputs for ``seqs`` in new arrays; ``width`` table columns (default: the longest table)."""
    n = len(seqs)
    width = width if width is not None else max(len(seq.block_table) for seq in seqs)
    rows = [np.empty(n, np.int64) for _ in range(5)]
    out = DecodeInputs(rows[0], rows[1], rows[2], np.empty((n, width), np.int64), rows[3], rows[4])
    fill_decode_inputs(seqs, block_size, out, pad_block)
    return out
