"""ModelRunner: turns a scheduled Batch into model inputs (ids, positions, slot mapping, block
tables, uploaded in one copy), runs the forward pass over the paged cache and returns one row of
logits per sampling row; and what completes a launched step (``completion``, ``copy_back``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from moriio_ray.engine.attention import AttnMetadata, decode_mask
from moriio_ray.engine.attention_prefill import ExtendRow, prefill_plan, split_decodes
from moriio_ray.engine.batch import Batch
from moriio_ray.engine.cuda_graph import DecodeGraphs
from moriio_ray.engine.device import Completion, device_tokens, upload
from moriio_ray.engine.inputs import step_inputs
from moriio_ray.engine.kv_cache import KVCache
from moriio_ray.engine.model import KVPair, LayerHook


class StepModel(Protocol):
    """What the runner needs of a model: ``model.CausalLM``, or ``sim_model.SimModel``."""

    @property
    def needs_attention_plan(self) -> bool:
        """Whether ``__call__`` reads the torch path's per-step attention precomputation."""
        ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVPair],
        meta: AttnMetadata,
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> the new tokens' hidden states [T, ...], their K/V written."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, ...] (rows of ``__call__``'s result) -> logits [N, vocab] float32."""
        ...


class ModelRunner:
    """Runs the model for one step; owns no scheduling state."""

    def __init__(
        self,
        model: StepModel,
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
        self.dtype = kv_cache.tensor.dtype  # the model's
        self.graphs = graphs
        # the Triton forward and the simulated model read none of the torch path's precomputation
        self.fused = not model.needs_attention_plan

    @property
    def asynchronous(self) -> bool:
        """Whether a step runs on after ``run`` returns (on a CUDA stream), so that overlapped
        scheduling has device work to hide the host's behind (its default: on)."""
        return self.device.type == "cuda"

    def completion(self) -> Completion | None:
        """What completes the work launched so far: a CUDA event recorded on the current stream;
        None on the CPU, whose work has run when the call returns."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def copy_back(self, packed: torch.Tensor) -> tuple[torch.Tensor, Completion | None]:
        """Start a step's one device-to-host copy of ``packed``: the host tensor it lands in (pinned
        on CUDA), and the completion after which both the step and the copy have run."""
        if packed.device.type != "cuda":
            return packed, self.completion()
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        return host, self.completion()

    def prepare(
        self, batch: Batch, prev_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata, torch.Tensor | None]:
        """(ids [T], positions [T], metadata, index [R] of the tokens that sample or None for all)."""
        host = step_inputs(batch, self.block_size)
        dev = upload(host.buffer, self.device)
        base = host.buffer.ctypes.data

        def view(a: np.ndarray) -> torch.Tensor:
            offset = (a.ctypes.data - base) // a.itemsize if a.size else 0
            return dev[offset : offset + a.size].view(a.shape)

        ids = view(host.ids)
        if host.from_device:
            ids = device_tokens(ids, view(host.src), prev_tokens)
        cu, tables, context_lens = view(host.cu_seqlens_q), view(host.block_tables), view(host.context_lens)
        nd, num_rows = host.num_decodes, len(host.q_lens)
        meta = AttnMetadata(
            slot_blocks=view(host.slot_blocks),
            slot_offsets=view(host.slot_offsets),
            num_decodes=nd,
            context_lens=context_lens,
            block_tables=tables,
            cu_seqlens_q=cu,
            q_lens=host.q_lens,
            start_pos=host.start_pos,
        )
        dtype = self.dtype
        if nd and not self.fused:
            self._plan_decodes(meta, host.decode_widths, host.start_pos, tables, context_lens)
        if nd < num_rows and not self.fused:
            lens = cu[nd + 1 :] - cu[nd:-1]  # [rows] the prefill rows' new tokens
            meta.prefill = prefill_plan(
                host.q_lens[nd:], host.start_pos[nd:], lens, tables[nd:], self.block_size, dtype
            )
        all_rows = host.sample_index.size == num_rows == host.ids.size
        sample_index = None if all_rows else view(host.sample_index)
        return ids, view(host.positions), meta, sample_index

    def _plan_decodes(
        self,
        meta: AttnMetadata,
        widths: list[int],
        start_pos: list[int],
        tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> None:
        """The decode rows' tables and mask, padded to the longest context of those batched."""
        nd, dtype = len(widths), self.dtype
        alone = split_decodes(widths)
        if not alone:
            width = max(widths)
            meta.decode_tables = tables[:nd, :width]
            meta.decode_mask = decode_mask(context_lens[:nd], width * self.block_size, dtype)
            return
        batched = [i for i in range(nd) if i not in set(alone)]
        width = max(widths[i] for i in batched)
        rows = upload(np.asarray(batched, np.int64), self.device)
        meta.decode_batched = rows
        meta.decode_tables = tables[:, :width].index_select(0, rows)
        meta.decode_mask = decode_mask(context_lens.index_select(0, rows), width * self.block_size, dtype)
        meta.decode_alone = [
            ExtendRow(i, i + 1, tables[i, : widths[i]], start_pos[i] + 1, None) for i in alone
        ]

    @torch.inference_mode()
    def run(
        self,
        batch: Batch,
        layer_hook: Callable[[int], None] | None = None,
        prev_tokens: torch.Tensor | None = None,
        keep: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits [R, vocab] (float32) for the next token of each row that samples, in row order
        (without ``with_logits``: whatever the forward pass left, for a rank that only keeps its
        KV). ``prev_tokens``: the previous step's sampled tokens, which rows fed from the device
        read. ``keep``: rows whose every token's final hidden state [q_len, hidden] the call puts in
        it (prompt logprobs), keyed by row."""
        if batch.is_decode and self.graphs is not None:
            logits = self.graphs.run(batch.seqs, prev_tokens)
            if logits is not None:
                return logits
        ids, positions, meta, sample_index = self.prepare(batch, prev_tokens)
        hidden = self.model(ids, positions, self.kv_cache.layers, meta, layer_hook)
        if not self.with_logits:
            return hidden
        if keep is not None:
            starts = np.cumsum([0, *batch.q_lens])
            for row in list(keep):
                keep[row] = hidden[int(starts[row]) : int(starts[row + 1])]
        if sample_index is not None:
            hidden = hidden[sample_index]
        return self.model.compute_logits(hidden)
