"""ModelRunner: turns a scheduled Batch into model inputs (ids, positions, slot mapping, block
tables), runs the forward pass over the paged cache and returns one row of logits per sequence."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from moriio_ray.engine.attention import AttnMetadata, decode_mask
from moriio_ray.engine.cuda_graph import DecodeGraphs
from moriio_ray.engine.inputs import decode_inputs
from moriio_ray.engine.kv_cache import KVCache
from moriio_ray.engine.model import CausalLM
from moriio_ray.engine.scheduler import Batch
from moriio_ray.engine.sequence import Sequence

# Above this many mask elements a mixed-length prefill runs one SDPA call per sequence instead.
MAX_PREFILL_MASK_ELEMS = 1 << 24


class ModelRunner:
    """Runs the model for one step; owns no scheduling state."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        device: torch.device,
        graphs: DecodeGraphs | None = None,
        with_logits: bool = True,
    ) -> None:
        self.model = model
        self.with_logits = with_logits  # False on tensor-parallel ranks other than 0: they never sample
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.layout.block_size
        self.graphs = graphs

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _slots(self, block_tables: list[list[int]], positions: list[np.ndarray]) -> tuple[np.ndarray, ...]:
        """(block, offset) of every new token, from each sequence's block table and positions."""
        blocks = [
            np.asarray(bt, dtype=np.int64)[pos // self.block_size]
            for bt, pos in zip(block_tables, positions, strict=True)
        ]
        return np.concatenate(blocks), np.concatenate(positions) % self.block_size

    def prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata]:
        """Inputs for a prefill of every sequence's tokens from position 0."""
        seq_lens = [seq.num_tokens for seq in seqs]
        ids = np.concatenate([np.asarray(seq.token_ids(), dtype=np.int64) for seq in seqs])
        positions = [np.arange(n, dtype=np.int64) for n in seq_lens]
        blocks, offsets = self._slots([seq.block_table for seq in seqs], positions)
        slot_blocks, slot_offsets = self._tensor(blocks), self._tensor(offsets)
        meta = AttnMetadata(True, slot_blocks, slot_offsets, seq_lens=seq_lens)
        max_len = meta.max_len
        if not meta.uniform and len(seqs) * max_len * max_len <= MAX_PREFILL_MASK_ELEMS:
            pad = np.concatenate([b * max_len + np.arange(n) for b, n in enumerate(seq_lens)])
            lens = torch.tensor(seq_lens, device=self.device)
            ar = torch.arange(max_len, device=self.device)
            causal = ar[None, :] <= ar[:, None]  # [L, L]: query i sees keys j <= i
            mask = causal[None] & (ar[None, None, :] < lens[:, None, None])  # [B, L, L]
            meta.pad_index, meta.prefill_mask = self._tensor(pad), mask[:, None]
        return self._tensor(ids), self._tensor(np.concatenate(positions)), meta

    def prepare_decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata]:
        """Inputs for one token per sequence: the last token, at position ``num_cached``."""
        host = decode_inputs(seqs, self.block_size)
        positions = self._tensor(host.positions)
        meta = AttnMetadata(
            is_prefill=False,
            slot_blocks=self._tensor(host.slot_blocks),
            slot_offsets=self._tensor(host.slot_offsets),
            block_tables=self._tensor(host.block_tables),
            decode_mask=decode_mask(positions + 1, host.block_tables.shape[1] * self.block_size),
        )
        return self._tensor(host.ids), positions, meta

    @torch.inference_mode()
    def run(self, batch: Batch, layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits [B, vocab] (float32) for the next token of each sequence in the batch (without
        ``with_logits``: whatever the forward pass left, for a rank that only keeps its KV)."""
        if not batch.is_prefill and self.graphs is not None:
            logits = self.graphs.run(batch.seqs)
            if logits is not None:
                return logits
        if batch.is_prefill:
            ids, positions, meta = self.prepare_prefill(batch.seqs)
        else:
            ids, positions, meta = self.prepare_decode(batch.seqs)
            layer_hook = None  # the hook reports prefill KV only
        hidden = self.model(ids, positions, self.kv_cache.layers, meta, layer_hook)
        if not self.with_logits:
            return hidden
        if batch.is_prefill:
            last = self._tensor(np.cumsum(meta.seq_lens) - 1)
            hidden = hidden[last]
        return self.model.compute_logits(hidden)
