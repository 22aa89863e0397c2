"""The one message per step that rank 0 of a tensor-parallel engine broadcasts to the other ranks.

Rank 0 schedules; every rank runs the same forward pass on its shard. Before each forward rank 0
broadcasts the batch (per row: the tokens fed, the cached length and the block table; the number
of decode rows; and the prefill rows' chunks, which the layer hook of a WRITE-mode push needs),
over the gloo control group, in one fixed-size buffer: one collective per step (two only for a
message past ``CAPACITY_BYTES``, a long prefill chunk), and none per layer. The other ranks rebuild
the batch and run it.
"""

from __future__ import annotations

import enum

import msgspec
import numpy as np
import torch

from moriio_ray.engine.batch import Batch, PrefillChunk
from moriio_ray.engine.inputs import last_token
from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.engine.sequence import Sequence
from moriio_ray.engine.tp import TPGroup, collective

CAPACITY_BYTES = 16 << 10
_HEADER_BYTES = 8
_PARAMS = SamplingParams()  # followers never sample: any params do


class Kind(enum.IntEnum):
    STEP = 1  # run this batch
    CAPTURE = 2  # capture every decode CUDA graph now
    STOP = 3  # the engine is closing: leave the loop


class StepMsg(msgspec.Struct, array_like=True):
    kind: Kind
    num_decodes: int = 0
    tokens: list[list[int]] = msgspec.field(default_factory=list)  # per row: the tokens fed
    num_cached: list[int] = msgspec.field(default_factory=list)
    tables: list[list[int]] = msgspec.field(default_factory=list)
    chunks: list[PrefillChunk] = msgspec.field(default_factory=list)  # the prefill rows'


def encode_batch(batch: Batch) -> StepMsg:
    """Rank 0's batch as a message (its tokens are on the host: overlap is off under TP)."""
    seqs, nd = batch.seqs, batch.num_decodes
    assert not any(seq.num_pending for seq in seqs), "a follower cannot read a token on rank 0's device"
    tokens = [[last_token(seq)] for seq in seqs[:nd]]
    tokens += [seq.tokens(seq.num_cached, n) for seq, n in zip(seqs[nd:], batch.q_lens[nd:], strict=True)]
    return StepMsg(
        Kind.STEP,
        nd,
        tokens,
        [seq.num_cached for seq in seqs],
        [list(seq.block_table) for seq in seqs],
        batch.prefill_chunks(),
    )


def decode_batch(msg: StepMsg) -> Batch:
    """The batch as the runner needs it (sequences carry only what the forward pass reads)."""
    seqs = []
    for cached, table in zip(msg.num_cached, msg.tables, strict=True):
        seq = Sequence("", [], _PARAMS, 0)
        seq.num_cached, seq.block_table = cached, table
        seqs.append(seq)
    q_lens = [len(t) for t in msg.tokens]
    return Batch(seqs, q_lens, msg.num_decodes, fed=msg.tokens, chunks=msg.chunks)


class StepChannel:
    """Broadcasts from rank 0 (``send``) to every other rank (``recv``) over the control group."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self.group = tp.control_group
        self._buf = torch.zeros(CAPACITY_BYTES, dtype=torch.uint8)
        self._view = self._buf.numpy()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StepMsg)
        self.num_sent = 0

    def send(self, msg: StepMsg) -> None:
        import torch.distributed as dist

        payload = self._encoder.encode(msg)
        n = len(payload)
        first = min(n, CAPACITY_BYTES - _HEADER_BYTES)
        self._view[:_HEADER_BYTES] = np.frombuffer(n.to_bytes(_HEADER_BYTES, "little"), dtype=np.uint8)
        self._view[_HEADER_BYTES : _HEADER_BYTES + first] = np.frombuffer(payload, np.uint8, first)
        collective(self.tp, dist.broadcast, self._buf, src=0, group=self.group)
        if n > first:
            rest = torch.frombuffer(bytearray(payload[first:]), dtype=torch.uint8)
            collective(self.tp, dist.broadcast, rest, src=0, group=self.group)
        self.num_sent += 1

    def recv(self) -> StepMsg:
        import torch.distributed as dist

        collective(self.tp, dist.broadcast, self._buf, src=0, group=self.group)
        n = int.from_bytes(self._view[:_HEADER_BYTES].tobytes(), "little")
        first = min(n, CAPACITY_BYTES - _HEADER_BYTES)
        payload = self._view[_HEADER_BYTES : _HEADER_BYTES + first].tobytes()
        if n > first:
            rest = torch.empty(n - first, dtype=torch.uint8)
            collective(self.tp, dist.broadcast, rest, src=0, group=self.group)
            payload += rest.numpy().tobytes()
        return self._decoder.decode(payload)
