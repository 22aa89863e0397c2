"""The simulated model (``model.preset: sim``): a forward pass that waits instead of computing, so
that the runtime around the engine (scheduler, worker, output streams, caller, HTTP ingress) runs at
GPU step rates on the CPU and its own cost shows.

Timing. A step launched at ``now`` ends on a virtual device at ``done_at = max(now, previous
done_at) + step_s``, with ``step_s = step_fixed_ms + step_per_decode_row_us * decode rows +
step_per_prefill_token_us * prefill tokens`` (``model.sim``). ``run`` returns at once, as a CUDA
launch does; the step's completion (``SimEvent``: what ``InFlight.wait`` and ``read`` and so
``Engine.reserve`` wait on) sleeps until ``done_at``. ``time.sleep`` releases the GIL and burns no
CPU, so the host is free for the runtime meanwhile. Overlapped scheduling is on by default, as on
CUDA: the host prepares step N+1 while the virtual device runs step N.

Calibration (the defaults): ``llama-1b`` in bfloat16 on one H200, Triton kernels and CUDA graphs
(bench/results/engine_llama-1b_cuda_bfloat16.json, measured at commit b6e39a9). Decode steps took
1.163, 1.378 and 1.707 ms at batch 1, 64 and 128; their least-squares line is 1.140 ms + 4.286 µs
per decode row (residuals -0.018, +0.037, -0.018 ms). One prefill step of 64 prompts of 128 tokens
took 33.58 ms (244k tokens/s): (33.58 - 1.14) ms / 8,192 tokens = 3.96 µs per prefill token (the
batch-128 step gives 3.90). Defaults: 1.14 ms, 4.29 µs, 3.96 µs. These are the engine's measured
step times, its own host work included, which the simulated engine adds again on the CPU: where that
work is not hidden under the virtual device's time, a simulated step is a little slower.

The KV cache is the engine's own ``KVCache`` (allocated through the transfer agent) of the geometry
in ``model.sim`` (by default llama-1b's: 16 layers, 8 KV heads, head_dim 64), so PD transfers move
real bytes through the real agents. For each new token the forward writes a marker into element
[head 0, dim 0] of its K and of its V slot in every layer, through the slot mapping the real model
uses (``AttnMetadata.slot_blocks``/``slot_offsets``), and nothing else of the slot. A marker is an
integer in [1, 256] (exact in every dtype): a hash of the token's id, its position and the layer.

A token's "hidden state" is a checksum of the markers read back from the cache through its row's
block table, one per context position j up to its own: ``sum((j + 1) * x_j)``, x_j the marker of
position j in one layer's K or V (a block column's own: every 2L blocks read each layer's K and V).
That read costs a cache line per context token and step, the one cost of the sim that grows with the
context (on a busy 2-core machine: 0.19 ms a step for 64 rows of about 160 tokens, 0.38 ms for 64
rows of about 1,000; writing the markers of 64 prompts of 128 tokens, about 5 ms of the step's 33.6
ms). Its logits [vocab] are a fixed spread in [0, 2) over the ids, plus 8 on the id a hash of the
checksum picks, so greedy decoding is deterministic and temperature, top-k/top-p, penalties,
logit_bias and logprobs all act on a real distribution. The picked id is printable ASCII (32..126):
greedy decoding never emits EOS (or another special id), so a request runs to ``max_tokens`` or a
stop string; a token sampled at a temperature may be any id, EOS included. A block that a transfer
moves wrongly, leaves stale or skips changes the checksum of every later token, and so (but for a
1-in-95 chance each) the tokens; a correct transfer gives exactly the colocated tokens.

Prompt logprobs work (every token's checksum is computed). Refused with a ConfigError: tensor
parallelism (the virtual device is one GPU: one rank per engine), ``engine.device: cuda`` (``auto``
is the CPU), and with them CUDA graphs and the backends that move GPU memory (cuda_ipc, mori: use
shm or tcp).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from moriio_ray.config import SimConfig
from moriio_ray.engine.attention import AttnMetadata
from moriio_ray.engine.device import Completion
from moriio_ray.engine.kv_cache import KVCache
from moriio_ray.engine.model import KVPair, LayerHook
from moriio_ray.engine.runner import ModelRunner
from moriio_ray.errors import ConfigError
from moriio_ray.transfer.layout import LAYER_MAJOR

MARGIN = 8.0  # the picked id's lead over the others: at temperature 1 its probability is 0.78 to 0.96
SPREAD = 2.0  # the other ids' logits lie in [0, SPREAD)
FIRST_ID, NUM_IDS = 32, 95  # a checksum picks one of ids 32..126 (printable ASCII bytes)
_LAYER_STEP = (37, 59)  # per layer, added to a token's K (V) marker hash


def sim_device(name: str) -> torch.device:
    """The simulated model's device for ``engine.device``: the CPU (``auto`` included)."""
    if name == "cuda":
        raise ConfigError(
            "engine.device: 'cuda' with model.preset sim: the simulated model runs on the CPU (its GPU "
            "is a timeline); set engine.device to cpu or auto"
        )
    return torch.device("cpu")


def step_s(sim: SimConfig, num_decode_rows: int, num_prefill_tokens: int) -> float:
    """The virtual device's time for a step of that many decode rows and prefill tokens."""
    return (
        sim.step_fixed_ms * 1e-3
        + sim.step_per_decode_row_us * 1e-6 * num_decode_rows
        + sim.step_per_prefill_token_us * 1e-6 * num_prefill_tokens
    )


class SimEvent:
    """A simulated step's completion: ``synchronize`` sleeps until the virtual device has run it."""

    def __init__(self, done_at: float) -> None:
        self.done_at = done_at  # on the time.monotonic() clock

    def synchronize(self) -> None:
        delay = self.done_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # releases the GIL: the runtime's threads run meanwhile

    def query(self) -> bool:
        """Whether the step has run (as ``torch.cuda.Event.query``)."""
        return time.monotonic() >= self.done_at


class VirtualDevice:
    """The simulated GPU: one stream, whose steps run one after another, each for its step time."""

    def __init__(self) -> None:
        self.done_at = 0.0  # when every step launched so far has run (time.monotonic())

    def launch(self, duration_s: float) -> None:
        self.done_at = max(time.monotonic(), self.done_at) + duration_s

    def completion(self) -> SimEvent:
        """The end of every step launched so far."""
        return SimEvent(self.done_at)


class SimModel:
    """The simulated model over ``cache`` (see the module docstring): markers in, checksums out.

    It satisfies ``runner.StepModel``: ``__call__`` returns each new token's checksum [T] int64 as
    its hidden state, and ``compute_logits`` turns checksums into logits. Its arithmetic is numpy on
    views of the (CPU) tensors: a handful of small ops a step, each far cheaper than torch's.
    """

    needs_attention_plan = False  # it reads the block tables and slot mapping, no attention plan

    def __init__(self, sim: SimConfig, cache: KVCache) -> None:
        self.sim = sim
        self.device = VirtualDevice()
        self.block_size = cache.layout.block_size
        self.num_layers = cache.layout.num_layers
        corner = cache.tensor[..., 0, 0]  # element [head 0, dim 0] of every slot
        # [L, 2, num_blocks, block_size], a view of the cache in either layout
        markers = corner if cache.layout.order == LAYER_MAJOR else corner.permute(1, 2, 0, 3)
        self.layer_stride, self.kv_stride, self.block_stride, self.slot_stride = markers.stride()
        assert cache.tensor.is_contiguous() and markers.storage_offset() == 0
        self.flat = cache.tensor.view(-1)  # markers[l, kv, b, s] is flat[l * layer_stride + ...]
        # the markers of one block's slots in one layer's K or V: a run of block_size elements,
        # slot_stride apart; row r of this view is the run that starts at flat[r]
        self.runs = self.flat.as_strided(
            (self.flat.numel() - (self.block_size - 1) * self.slot_stride, self.block_size),
            (1, self.slot_stride),
        )
        layers = np.arange(self.num_layers)[:, None, None]  # [L, 1, 1]
        kv = np.arange(2)[None, :, None]  # [1, 2, 1]
        self.layer_offsets = layers * self.layer_stride + kv * self.kv_stride  # [L, 2, 1]
        # added to a token's K (V) marker hash per layer: a block of the wrong layer reads differently
        self.layer_shift = layers * np.array(_LAYER_STEP)[None, :, None]  # [L, 2, 1]
        self.slot_weights = np.arange(1, self.block_size + 1)  # [bs] position + 1 within a block
        spread = (_fibonacci(np.arange(sim.vocab_size)) >> np.uint64(40)).astype(np.float32)
        self.spread = torch.from_numpy(spread * (SPREAD / (1 << 24)))  # [V] in [0, SPREAD)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[KVPair],
        meta: AttnMetadata,
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor:
        """Launch the step on the virtual device, write the new tokens' markers (``kv_caches`` are
        views of the cache it writes through ``flat``) and return their checksums [T] int64."""
        ids, pos = input_ids.numpy(), positions.numpy()
        num_decodes = meta.num_decodes
        self.device.launch(step_s(self.sim, num_decodes, ids.size - num_decodes))
        mixed = _fibonacci((ids << 20) + pos)  # [T] uint64 (positions are below 2**17)
        base = np.stack([mixed >> np.uint64(56), (mixed >> np.uint64(48)) & np.uint64(0xFF)])  # [2, T]
        values = (base.astype(np.int64) + self.layer_shift) % 256 + 1  # [L, 2, T] K's and V's
        slots = meta.slot_blocks.numpy() * self.block_stride + meta.slot_offsets.numpy() * self.slot_stride
        index = torch.from_numpy(self.layer_offsets + slots)  # [L, 2, T] into flat
        source = torch.from_numpy(values).to(self.flat.dtype)
        if layer_hook is None:
            self.flat.index_copy_(0, index.view(-1), source.view(-1))  # every layer in one write
        else:  # a WRITE push sends layer i from hook(i): its markers are written, layer i + 1's not yet
            for i in range(self.num_layers):
                self.flat.index_copy_(0, index[i].reshape(-1), source[i].reshape(-1))
                layer_hook(i)
        return self._checksums(pos, meta)

    def _checksums(self, positions: np.ndarray, meta: AttnMetadata) -> torch.Tensor:
        """[T] int64: for each new token, the sum over its row's positions j up to its own of
        (j + 1) * x_j, x_j the marker read back at position j through the row's block table.

        Block column w of a row (positions [w * block_size, (w + 1) * block_size)) is read in layer
        w mod L, its K for even w div L and its V for odd: every 2L blocks read each layer's K and V.
        The rows' blocks are packed back to back (no padding to the longest row)."""
        lens, tables, cu = meta.context_lens, meta.block_tables, meta.cu_seqlens_q
        assert lens is not None and tables is not None and cu is not None
        bs, num_layers = self.block_size, self.num_layers
        widths = (lens.numpy() + (bs - 1)) // bs  # [B] blocks of each row's context
        ends = np.cumsum(widths)
        first = ends - widths  # [B] each row's first block among the packed ones
        block_row = np.repeat(np.arange(widths.size), widths)  # [K]
        column = np.arange(int(ends[-1])) - first[block_row]  # [K] each block's column in its row's table
        runs = (
            tables.numpy()[block_row, column] * self.block_stride
            + (column % num_layers) * self.layer_stride
            + ((column // num_layers) & 1) * self.kv_stride
        )  # [K] where each block's run of markers starts in flat
        # the markers are integers in [1, 256]; a slot never written is cut to 9 bits too
        x = self.runs[torch.from_numpy(runs)].to(torch.int64).numpy() & 0x1FF  # [K, bs]
        # packed prefix sums [K * bs + 1]: a term is below 2**9 * 2**17 (max_model_len), so no overflow
        sums = np.zeros(x.size + 1, np.int64)
        np.cumsum((x * (column[:, None] * bs + self.slot_weights)).ravel(), out=sums[1:])
        start = np.repeat(first * bs, np.diff(cu.numpy()))  # [T] the packed index of its row's position 0
        return torch.from_numpy(sums[start + positions + 1] - sums[start])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Checksums [N] int64 -> logits [N, vocab] float32: the spread, plus MARGIN on the id each
        checksum picks."""
        picked = FIRST_ID + (_fibonacci(hidden.numpy()) >> np.uint64(40)) % np.uint64(NUM_IDS)  # [N]
        num_rows = hidden.shape[0]
        logits = self.spread.expand(num_rows, -1).clone()  # [N, V]
        logits[torch.arange(num_rows), torch.from_numpy(picked.astype(np.int64))] += MARGIN
        return logits


def _fibonacci(x: np.ndarray) -> np.ndarray:
    """Fibonacci hashing: x (non-negative int64) times 2**64 / golden ratio, mod 2**64, whose top
    bits are well mixed."""
    return x.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)


class SimRunner(ModelRunner):
    """The runner of ``SimModel``: the real step inputs, and completions on its virtual device."""

    def __init__(self, model: SimModel, kv_cache: KVCache, device: torch.device) -> None:
        super().__init__(model, kv_cache, device)
        self.virtual = model.device

    @property
    def asynchronous(self) -> bool:
        return True  # a step runs on the virtual device after ``run`` returns

    def completion(self) -> Completion | None:
        return self.virtual.completion()
