"""CUDA graphs of the decode forward pass, keyed by (batch bucket, context bucket).

A decode step launches a few hundred small kernels; replaying one captured graph removes their
launch cost. Inputs live in static device buffers that every graph reads through views; a batch is
padded up to its bucket with rows that read and write only a reserved scratch block, and the
gathered context is padded up to a power of two (masked). Graphs are captured on first use and
share one memory pool, which is safe because each replay's logits are consumed before the next.
A step whose gathered K/V would exceed ``max_gather_bytes`` runs eagerly instead. With the Triton
kernels (``engine.kernels``) nothing is gathered: attention reads each row's own context through
its table, so one width (the longest sequence's) serves every context and there is one graph per
batch bucket. Workers capture every graph before they serve (``capture_all``), so no request waits
for a capture.
"""

from __future__ import annotations

from typing import Any

import torch

from moriio_ray.engine.attention import AttnMetadata, decode_mask
from moriio_ray.engine.device import device_tokens
from moriio_ray.engine.inputs import DecodeInputs, fill_decode_inputs
from moriio_ray.engine.model import CausalLM, KVPair
from moriio_ray.engine.sequence import Sequence

MIN_CONTEXT_SLOTS = 256


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to ``max_batch`` (which is always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return [*sizes, max_batch]


class DecodeGraphs:
    """Captures and replays decode graphs for one model and KV cache on one CUDA device."""

    def __init__(
        self,
        model: CausalLM,
        kv_layers: list[KVPair],
        block_size: int,
        scratch_block: int,
        max_batch: int,
        max_model_len: int,
        device: torch.device,
        max_gather_bytes: int = 2 << 30,
        with_logits: bool = True,
    ) -> None:
        self.model, self.kv_layers, self.block_size = model, kv_layers, block_size
        self.with_logits = with_logits  # tensor-parallel ranks other than 0 capture without the LM head
        self.scratch_block = scratch_block
        self.buckets = batch_buckets(max_batch)
        self.max_width = -(-max_model_len // block_size)  # block-table columns of the longest sequence
        args = model.args
        dtype_bytes = model.model.embed_tokens.weight.element_size()
        self.slot_bytes = 2 * args.num_kv_heads * args.head_dim * dtype_bytes  # K + V of one token
        self.max_gather_bytes = max_gather_bytes
        self.device = device
        max_b = self.buckets[-1]
        # Every static input lives in one device buffer, staged in one pinned host buffer of the
        # same layout: [ids | src | positions | slot blocks | slot offsets | tables (max_b x
        # max_width)], so a step uploads its inputs with a single copy of the buffer's first rows.
        self._rows = 5 * max_b
        numel = self._rows + max_b * self.max_width
        self._static = torch.zeros(numel, dtype=torch.int64, device=device)
        views = self._views(self._static)
        self.ids, self.src, self.positions, self.slot_blocks, self.slot_offsets, self.tables = views
        # two staging buffers, used in turn: under overlapped scheduling a step is loaded while the
        # previous one (whose upload may still be queued) runs; the one before that has ended
        self._stagings = [
            torch.zeros(numel, dtype=torch.int64, pin_memory=device.type == "cuda") for _ in range(2)
        ]
        self._hosts = []
        for staging in self._stagings:
            ids, src, positions, slot_blocks, slot_offsets, tables = (v.numpy() for v in self._views(staging))
            host = DecodeInputs(ids, src, positions, tables, slot_blocks, slot_offsets)
            host.slot_blocks.fill(scratch_block)
            host.block_tables.fill(scratch_block)
            self._hosts.append(host)
        self._static.copy_(self._stagings[0])
        self._turn = 0
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None  # the graphs' shared memory pool, after the first capture
        self.num_replays = 0

    def _views(self, buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        max_b = self._rows // 5
        rows = [buf[i * max_b : (i + 1) * max_b] for i in range(5)]
        return (*rows, buf[self._rows :].view(max_b, self.max_width))

    def _key(self, seqs: list[Sequence]) -> tuple[int, int] | None:
        batch = len(seqs)
        bucket = next((b for b in self.buckets if b >= batch), None)
        if bucket is None:
            return None
        if self.model.fused:  # the kernel reads only each row's context: any width will do
            return bucket, self.max_width
        context = max(seq.num_cached for seq in seqs) + 1
        slots = max(MIN_CONTEXT_SLOTS, 1 << (context - 1).bit_length())
        width = min(-(-slots // self.block_size), self.max_width)
        if width < max(len(seq.block_table) for seq in seqs):
            return None
        if bucket * width * self.block_size * self.slot_bytes > self.max_gather_bytes:
            return None
        return bucket, width

    def _forward(self, bucket: int, width: int) -> torch.Tensor:
        positions = self.positions[:bucket]
        tables = self.tables[:bucket, :width]
        meta = AttnMetadata(
            slot_blocks=self.slot_blocks[:bucket],
            slot_offsets=self.slot_offsets[:bucket],
            num_decodes=bucket,
            context_lens=positions + 1,
            block_tables=tables,
        )
        if not self.model.fused:  # the torch path's mask (the Triton kernel reads the lengths)
            meta.decode_tables = tables
            meta.decode_mask = decode_mask(positions + 1, width * self.block_size)
        hidden = self.model(self.ids[:bucket], positions, self.kv_layers, meta)
        return self.model.compute_logits(hidden) if self.with_logits else hidden

    def _capture(self, bucket: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(bucket, width)  # warm-up: lazy initialisation must not happen inside capture
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a worker's other threads (transfers, event polls) may use CUDA meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self._forward(bucket, width)
        self.pool = graph.pool()
        return graph, logits

    def keys(self) -> list[tuple[int, int]]:
        """Every (batch bucket, block-table width) a decode step can use, within the gather limit."""
        if self.model.fused:
            return [(bucket, self.max_width) for bucket in self.buckets]
        widths: list[int] = []
        slots = MIN_CONTEXT_SLOTS
        while True:
            width = min(-(-slots // self.block_size), self.max_width)
            if width not in widths:
                widths.append(width)
            if width >= self.max_width:
                break
            slots *= 2
        return [
            (bucket, width)
            for width in widths
            for bucket in self.buckets
            if bucket * width * self.block_size * self.slot_bytes <= self.max_gather_bytes
        ]

    def capture_all(self) -> int:
        """Capture every graph now (largest first, so that later captures reuse the pool's memory)."""
        for key in reversed(self.keys()):
            if key not in self.graphs:
                self.graphs[key] = self._capture(*key)
        torch.cuda.synchronize(self.device)
        return len(self.graphs)

    def _load(
        self, seqs: list[Sequence], bucket: int, width: int, prev_tokens: torch.Tensor | None = None
    ) -> None:
        """Write the batch into the static buffers; padding rows feed token 0 into the scratch block.
        Tokens still on the device come from ``prev_tokens`` (the previous step's samples)."""
        self._turn ^= 1
        h, n, staging = self._hosts[self._turn], len(seqs), self._stagings[self._turn]
        tables = h.block_tables[:bucket, :width]
        view = DecodeInputs(h.ids, h.src, h.positions, tables, h.slot_blocks, h.slot_offsets)
        fill_decode_inputs(seqs, self.block_size, view, pad_block=self.scratch_block)
        from_device = bool((h.src[:n] >= 0).any())
        h.ids[n:bucket] = 0
        h.positions[n:bucket] = 0
        h.slot_blocks[n:bucket] = self.scratch_block
        h.slot_offsets[n:bucket] = 0
        tables[n:bucket] = self.scratch_block
        used = self._rows + bucket * self.max_width
        self._static[:used].copy_(staging[:used], non_blocking=True)
        if from_device:
            self.ids[:n] = device_tokens(self.ids[:n], self.src[:n], prev_tokens)

    def run(self, seqs: list[Sequence], prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [len(seqs), vocab] from a graph replay, or None when this batch must run eagerly."""
        key = self._key(seqs)
        if key is None:
            return None
        self._load(seqs, *key, prev_tokens)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(*key)
        graph, logits = entry
        graph.replay()
        self.num_replays += 1
        return logits[: len(seqs)]
