"""WRITE mode: push each layer of a prefill into the decode engine's reserved blocks as it is computed.

A prompt prefilled in chunks (several steps) is pushed chunk by chunk: per layer, the blocks that
the chunk completed (``PrefillChunk.ready_blocks``), so each block goes once, whole, and the
prompt's last partial block with the last chunk.

Prefix caching: D's reservation names how many of the prompt's first blocks D holds already
(``first_block``); those are never pushed. Blocks P found in its own cache were never computed
here: they go with the first chunk computed, so every block from ``first_block`` on goes once.

Under tensor parallelism every P rank runs a pusher for its own KV heads, with one target per D
rank that holds some of them (``plan.rank_pairs``): per layer and chunk, one batched write per
target.
"""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np

from moriio_ray.engine.batch import PrefillChunk
from moriio_ray.errors import TransferError, TransferTimeout
from moriio_ray.protocol.messages import RankDesc
from moriio_ray.transfer.base import TransferAgent
from moriio_ray.transfer.desc import MemoryDesc
from moriio_ray.transfer.handle import Transfer
from moriio_ray.transfer.layout import KVLayout
from moriio_ray.transfer.plan import TransferPlan, plan_blocks, rank_pairs


def layer_stride_bytes(layout: KVLayout) -> int:
    """Bytes between layer i and layer i+1 of the same (kv, block): offsets are linear in the layer."""
    one = np.ones(1, dtype=np.int64)
    zero = np.zeros(1, dtype=np.int64)
    return int(layout.segment_offsets(one, zero, zero)[0] - layout.segment_offsets(zero, zero, zero)[0])


class PushOrder(msgspec.Struct, frozen=True):
    """Rank 0's order to another P rank: push its KV heads of one prefill into D's reserved blocks."""

    request_id: str
    peer_ranks: list[RankDesc]  # D's ranks
    dest_blocks: list[int]
    last_push_unix: float | None  # no push starts after this
    first_block: int = 0  # D holds the blocks before this one: they are never pushed


def push_targets(local_layout: KVLayout, peer_ranks: list[RankDesc]) -> list[RankDesc]:
    """The D ranks that hold some of this rank's KV heads (all of D's one rank at TP = 1)."""
    return [peer_ranks[j] for _, j in rank_pairs([local_layout], [r.layout for r in peer_ranks])]


class LayerPusher:
    """Runs on the engine thread: ``on_layer`` issues one batched write per computed layer and target.

    Ordering on CUDA: the hook runs right after layer i's K/V writes were queued on the engine's
    current stream, and backends start a GPU copy after the work already queued on the caller's
    current stream (``cuda_ipc`` records that point as an event), so the push of layer i waits
    for exactly layer i's compute, with no device-wide sync, while layer i+1 computes.
    """

    def __init__(
        self,
        agent: TransferAgent,
        local_mem: MemoryDesc,
        local_layout: KVLayout,
        targets: list[RankDesc],
        dest_blocks: list[int],
        last_push_unix: float | None = None,
        first_block: int = 0,
    ) -> None:
        if not targets:
            raise TransferError(f"{agent.key}: no decode rank holds KV heads {list(local_layout.heads)}")
        self.agent = agent
        self.local_mem = local_mem
        self.local_layout = local_layout
        self.targets = targets
        self.dest_blocks = dest_blocks
        self._next_block = first_block  # the first block not pushed yet (D holds those before it)
        self._range = (first_block, first_block)  # the blocks the chunk being pushed sends
        # no push starts after this (D frees the reservation at its deadline plus grace)
        self.last_push_unix = last_push_unix
        self.transfers: list[Transfer] = []
        self.error: BaseException | None = None
        self.num_bytes = 0
        self.num_segments = 0
        self.num_layers = local_layout.num_layers
        self.num_layers_pushed = 0  # of the latest chunk
        # set once the last layer of the last chunk is pushed (or a push failed): a rank other than
        # 0 may run its forward pass a little behind rank 0, which asks it to wait
        self.complete = threading.Event()
        # the blocks of the chunk being pushed, and per target layer 0's plan and the remote layer stride
        self._plans: tuple[tuple[int, int], list[tuple[TransferPlan, int]]] | None
        self._plans = None
        self._local_stride = layer_stride_bytes(local_layout)
        self._lock = threading.Lock()  # on_layer (engine thread) against close (asyncio thread)
        self.closed = False

    def on_layer(self, layer: int, chunk: PrefillChunk, local_blocks: list[int]) -> None:
        """Push ``layer`` of the blocks ``chunk`` completed (``local_blocks``: the prompt's blocks
        here); errors are kept for ``wait_all`` (never raised here)."""
        with self._lock:
            if self.error is None and not self.closed:
                self._push(layer, chunk, local_blocks)

    def _push(self, layer: int, chunk: PrefillChunk, local_blocks: list[int]) -> None:
        try:
            if self.last_push_unix is not None and time.time() > self.last_push_unix:
                raise TransferTimeout(
                    f"{self.agent.key}: the reservation's deadline passed before layer {layer} was pushed"
                )
            if layer == 0:  # every layer of a chunk sends the same blocks
                end = max(self._next_block, chunk.ready_blocks(self.local_layout.block_size)[1])
                self._range = (self._next_block, end)
            first, end = self._range
            if layer == self.num_layers - 1:
                self._next_block = end
            if first < end:
                if self._plans is None or self._plans[0] != (first, end):
                    self._plans = ((first, end), self._plan(local_blocks, first, end))
                local_step = layer * self._local_stride
                for target, (plan, remote_stride) in zip(self.targets, self._plans[1], strict=True):
                    layer_plan = plan.shifted(local_step, layer * remote_stride)
                    xfer = self.agent.write(self.local_mem, target.kv_mem, layer_plan)
                    self.transfers.append(xfer)
                    self.num_bytes += xfer.num_bytes
                    self.num_segments += xfer.num_segments
            self.num_layers_pushed = layer + 1
            if layer == self.num_layers - 1 and chunk.is_last:
                self.complete.set()
        except BaseException as exc:
            self.error = exc
            self.complete.set()

    def _plan(self, local_blocks: list[int], first: int, end: int) -> list[tuple[TransferPlan, int]]:
        dest = self.dest_blocks
        if len(local_blocks) < len(dest):
            raise TransferError(
                f"prefill holds {len(local_blocks)} blocks, the reservation expects {len(dest)}"
            )
        plans = []
        for target in self.targets:
            plan = plan_blocks(
                local_blocks[first:end], dest[first:end], self.local_layout, target.layout, range(0, 1)
            )
            plans.append((plan, layer_stride_bytes(target.layout)))
        return plans

    def wait_all(self, timeout_s: float) -> None:
        """Wait until the last layer is pushed, then for every push (blocking; call from a thread)."""
        deadline = time.monotonic() + timeout_s
        if not self.complete.wait(timeout_s):
            raise TransferTimeout(
                f"{self.agent.key}: the prefill pushed {self.num_layers_pushed} of {self.num_layers} "
                f"layers of its last chunk within {timeout_s} s"
            )
        if self.error is not None:
            raise self.error
        for xfer in self.transfers:
            xfer.wait(max(0.0, deadline - time.monotonic()))

    def settle(self, timeout_s: float) -> bool:
        """Start no more pushes, then wait until every push started has ended, well or not (at most
        ``timeout_s``; blocking). True when none can land any more."""
        with self._lock:
            self.closed = True
            started = list(self.transfers)
        end_s = time.monotonic() + timeout_s
        for xfer in started:
            try:
                xfer.wait(max(0.0, end_s - time.monotonic()))
            except Exception:
                if not xfer.done():
                    return False  # still running: it may land later
        return True
