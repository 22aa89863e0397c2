"""Continuous batching: each step is either a prefill batch or a decode batch.

Prefill goes first: waiting sequences are admitted in FIFO order while ``max_num_seqs``,
``max_num_batched_tokens`` (a single longer prompt still runs alone) and free blocks allow. Otherwise
every running sequence decodes one token; when one needs a block and none is free, the youngest
running sequence is preempted (its blocks freed, and it is recomputed by a later prefill).
"""

from __future__ import annotations

import collections
import dataclasses

from moriio_ray.engine.block_allocator import BlockAllocator
from moriio_ray.engine.sequence import SeqState, Sequence, blocks_for


@dataclasses.dataclass
class Batch:
    """The sequences of one forward pass; a prefill feeds all their uncached tokens, a decode one each."""

    is_prefill: bool
    seqs: list[Sequence]


class Scheduler:
    """Owns the waiting queue and the running set, and the blocks their sequences hold."""

    def __init__(
        self, allocator: BlockAllocator, block_size: int, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: collections.deque[Sequence] = collections.deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a sequence for prefill, or (KV injected) for a place in the running set."""
        seq.state = SeqState.WAITING
        self.waiting.append(seq)

    def can_schedule(self) -> bool:
        """Whether ``schedule`` would return a batch now (something runs, or the queue's head fits)."""
        if self.running:
            return True
        if not self.waiting:
            return False
        head = self.waiting[0]
        need = blocks_for(head.num_tokens, self.block_size) - len(head.block_table)
        return head.num_cached > 0 or self.allocator.can_allocate(need)

    def schedule(self) -> Batch | None:
        prefill = self._schedule_prefill()
        if prefill:
            return Batch(is_prefill=True, seqs=prefill)
        decode = self._schedule_decode()
        return Batch(is_prefill=False, seqs=decode) if decode else None

    def _schedule_prefill(self) -> list[Sequence]:
        batch: list[Sequence] = []
        num_batched = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_cached > 0:  # its prompt KV was injected: it only needs a place to decode
                self.waiting.popleft()
                seq.state = SeqState.RUNNING
                self.running.append(seq)
                continue
            num_new = seq.num_tokens
            if batch and num_batched + num_new > self.max_num_batched_tokens:
                break
            need = blocks_for(seq.num_tokens, self.block_size) - len(seq.block_table)
            if not self.allocator.can_allocate(need):
                break
            seq.block_table += self.allocator.allocate(need)
            self.waiting.popleft()
            seq.state = SeqState.RUNNING
            self.running.append(seq)
            batch.append(seq)
            num_batched += num_new
        return batch

    def _schedule_decode(self) -> list[Sequence]:
        batch: list[Sequence] = []
        while self.running and len(batch) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self._can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())  # the youngest
                else:
                    self.preempt(seq)
                    break
            else:
                if seq.num_cached // self.block_size == len(seq.block_table):
                    seq.block_table += self.allocator.allocate(1)
                batch.append(seq)
        self.running.extendleft(reversed(batch))
        return batch

    def _can_append(self, seq: Sequence) -> bool:
        # the token fed next lands at position num_cached
        return seq.num_cached // self.block_size < len(seq.block_table) or self.allocator.can_allocate(1)

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and queue it first for recomputation."""
        self.num_preemptions += 1
        self._free_blocks(seq)
        seq.num_cached = 0
        seq.state = SeqState.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """A running sequence is done: drop it and free its blocks."""
        self.running.remove(seq)
        self._free_blocks(seq)
        seq.state = SeqState.FINISHED

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is (abort) and free its blocks; a no-op for unknown ones."""
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
        self._free_blocks(seq)
        seq.state = SeqState.FINISHED

    def _free_blocks(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []
