"""WRITE mode: push each layer of a prefill into the decode engine's reserved blocks as it is computed."""

from __future__ import annotations

import time

import numpy as np

from moriio_ray.errors import TransferError
from moriio_ray.runtime.messages import Reservation, WorkerInfo
from moriio_ray.transfer.base import TransferAgent
from moriio_ray.transfer.desc import MemoryDesc
from moriio_ray.transfer.handle import Transfer
from moriio_ray.transfer.layout import KVLayout
from moriio_ray.transfer.plan import plan_blocks


def layer_stride_bytes(layout: KVLayout) -> int:
    """Bytes between layer i and layer i+1 of the same (kv, block): offsets are linear in the layer."""
    one = np.ones(1, dtype=np.int64)
    zero = np.zeros(1, dtype=np.int64)
    return int(layout.segment_offsets(one, zero, zero)[0] - layout.segment_offsets(zero, zero, zero)[0])


class LayerPusher:
    """Runs on the engine thread: ``on_layer`` issues one batched write per computed layer.

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
        peer: WorkerInfo,
        reservation: Reservation,
    ) -> None:
        if peer.kv_mem is None:
            raise TransferError(f"peer {peer.key!r} published no KV region")
        self.agent = agent
        self.local_mem = local_mem
        self.local_layout = local_layout
        self.peer = peer
        self.remote_mem: MemoryDesc = peer.kv_mem
        self.reservation = reservation
        self.transfers: list[Transfer] = []
        self.error: BaseException | None = None
        self.num_bytes = 0
        self.num_segments = 0
        self._plan: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._strides = (layer_stride_bytes(local_layout), layer_stride_bytes(peer.layout))

    def on_layer(self, layer: int, local_blocks: list[int]) -> None:
        """Push ``layer`` of the prompt's blocks; errors are kept for ``wait_all`` (never raised here)."""
        if self.error is not None:
            return
        try:
            if self._plan is None:
                dest = self.reservation.block_ids
                if len(local_blocks) < len(dest):
                    raise TransferError(
                        f"prefill holds {len(local_blocks)} blocks, the reservation expects {len(dest)}"
                    )
                plan = plan_blocks(
                    local_blocks[: len(dest)], dest, self.local_layout, self.peer.layout, range(0, 1)
                )
                self._plan = (plan.local_offsets, plan.remote_offsets, plan.sizes)
            lo, ro, sz = self._plan
            local_stride, remote_stride = self._strides
            xfer = self.agent.write(
                self.local_mem,
                self.remote_mem,
                lo + layer * local_stride,
                ro + layer * remote_stride,
                sz,
            )
            self.transfers.append(xfer)
            self.num_bytes += xfer.num_bytes
            self.num_segments += xfer.num_segments
        except BaseException as exc:
            self.error = exc

    def wait_all(self, timeout_s: float) -> None:
        """Wait for every pushed layer (blocking; call from a thread)."""
        if self.error is not None:
            raise self.error
        deadline = time.monotonic() + timeout_s
        for xfer in self.transfers:
            xfer.wait(max(0.0, deadline - time.monotonic()))
