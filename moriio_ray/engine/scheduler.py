"""Continuous batching with chunked prefill: each step is every running decode plus prefill chunks.

A step's budget is ``max_num_batched_tokens`` tokens. Decodes go first: every running sequence
whose prompt is cached feeds one token (when it needs a block and none is free, the youngest
running sequence is preempted: its blocks are freed and it is recomputed later). Prefill chunks
fill the rest of the budget: first the running sequences still prefilling (oldest first), then
waiting ones in FIFO order while ``max_num_seqs`` and free blocks allow. A waiting sequence gets
the blocks of all its tokens when it is admitted, so a prompt whose prefill spans several steps
never waits for blocks halfway. Without ``chunked_prefill`` a prompt is never split: one that does
not fit the remaining budget waits, unless the step holds no prefill yet (then it runs whole).

Sequences whose KV was injected (a decode engine's ``start_decode``) join the running set at once
and decode in the same step.

Prefix caching (the allocator has a ``PrefixCache``): an admitted sequence starts from the cached
blocks of the longest prefix of its tokens, short of its last token (a step must feed at least one
token, and never into a block found in the cache), and prefills the rest. ``register_computed``
registers each full block once its KV is computed: a sequence aborted part-way leaves only complete
blocks behind.
"""

from __future__ import annotations

import collections

from moriio_ray.engine.batch import Batch
from moriio_ray.engine.block_allocator import BlockAllocator
from moriio_ray.engine.prefix_cache import ROOT_KEY, block_keys
from moriio_ray.engine.sequence import SeqState, Sequence, blocks_for


class Scheduler:
    """Owns the waiting queue and the running set, and the blocks their sequences hold."""

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        chunked_prefill: bool = True,
    ) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked_prefill = chunked_prefill
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: collections.deque[Sequence] = collections.deque()  # oldest first
        self.num_preemptions = 0
        self.num_queried_tokens = 0  # prefix caching: prompt tokens looked up at first admission
        self.num_hit_tokens = 0  # of which found cached

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
        return head.num_cached > 0 or self._admission(head) is not None

    def schedule(self) -> Batch | None:
        self._join_injected()
        decodes = self._schedule_decodes()
        budget = self.max_num_batched_tokens - len(decodes)
        seqs, q_lens = list(decodes), [1] * len(decodes)
        for seq in self.running:  # prompts part-way through their prefill, oldest first
            if budget <= 0:
                break
            if seq.is_prefilling:
                n = min(seq.num_ahead - seq.num_cached, budget)
                seqs.append(seq)
                q_lens.append(n)
                budget -= n
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self._admission(seq)
            if hits is None:
                break
            remaining = seq.num_ahead - max(seq.num_cached, len(hits) * self.block_size)
            if not self.chunked_prefill and remaining > budget and len(seqs) > len(decodes):
                break  # unsplit prompts: it waits for a step with room
            self.take_blocks(seq, hits, blocks_for(seq.num_ahead, self.block_size))
            if hits:
                seq.num_cached = len(hits) * self.block_size
            self.waiting.popleft()
            seq.state = SeqState.RUNNING
            self.running.append(seq)
            n = remaining if not self.chunked_prefill else min(remaining, budget)
            seqs.append(seq)
            q_lens.append(n)
            budget -= n
        return Batch(seqs, q_lens, len(decodes)) if seqs else None

    def _blocks_needed(self, seq: Sequence) -> int:
        return blocks_for(seq.num_ahead, self.block_size) - len(seq.block_table)

    def _admission(self, seq: Sequence) -> list[int] | None:
        """The cached blocks a waiting sequence would start from, if the free blocks let it in now;
        None if they do not. A sequence holding blocks already (a reserved recompute) finds none, and
        so does one that asked for prompt logprobs: they come from the logits of every prompt token."""
        fresh = not seq.block_table and seq.params.prompt_logprobs is None
        hits = self.cached_prefix(seq, seq.num_ahead - 1) if fresh else []
        return hits if self.fits(seq, hits, blocks_for(seq.num_ahead, self.block_size)) else None

    def fits(self, seq: Sequence, hits: list[int], num_blocks: int) -> bool:
        """Whether ``seq`` can hold ``num_blocks`` blocks now, ``hits`` among them."""
        need = num_blocks - len(seq.block_table) - len(hits)
        return self.allocator.can_allocate(need + self.allocator.acquire_cost(hits))

    def cached_prefix(self, seq: Sequence, max_tokens: int) -> list[int]:
        """The cached blocks of the longest prefix of ``seq``'s tokens, within ``max_tokens``."""
        if self.allocator.cache is None:
            return []
        num_blocks = min(max_tokens, seq.num_tokens) // self.block_size
        self._extend_keys(seq, num_blocks)
        return self.allocator.match(seq.block_keys[:num_blocks])

    def take_blocks(self, seq: Sequence, hits: list[int], num_blocks: int) -> None:
        """Give ``seq`` its blocks up to ``num_blocks``: ``hits`` (referenced again), then new ones
        (``fits`` said they are there). Its first admission counts towards the hit rate."""
        if hits:
            self.allocator.acquire(hits)
            seq.block_table = list(hits)
            seq.num_registered = len(hits)
        seq.block_table += self.allocator.allocate(num_blocks - len(seq.block_table))
        if not seq.admitted and self.allocator.cache is not None:
            seq.admitted = True
            seq.num_hit_tokens = len(hits) * self.block_size
            self.num_queried_tokens += seq.num_prompt_tokens
            self.num_hit_tokens += seq.num_hit_tokens

    def register_computed(self, seq: Sequence) -> None:
        """Register ``seq``'s full blocks whose KV is now computed (or transferred in) and whose
        tokens the host knows (an overlapped step's pending token is not known yet)."""
        if self.allocator.cache is None:
            return
        num_full = min(seq.num_cached, seq.num_tokens, len(seq.block_table) * self.block_size)
        num_full //= self.block_size
        if num_full <= seq.num_registered:
            return
        self._extend_keys(seq, num_full)
        for i in range(seq.num_registered, num_full):
            self.allocator.register(seq.block_table[i], seq.block_keys[i])
        seq.num_registered = num_full

    def _extend_keys(self, seq: Sequence, num_blocks: int) -> None:
        keys = seq.block_keys
        if len(keys) < num_blocks:
            start = len(keys) * self.block_size
            tokens = seq.tokens(start, (num_blocks - len(keys)) * self.block_size)
            keys += block_keys(tokens, self.block_size, keys[-1] if keys else ROOT_KEY)

    def _join_injected(self) -> None:
        """Waiting sequences whose prompt KV is in place join the running set (they decode now)."""
        if not any(seq.num_cached > 0 for seq in self.waiting):
            return
        for seq in [s for s in self.waiting if s.num_cached > 0]:
            if len(self.running) >= self.max_num_seqs:
                return
            self.waiting.remove(seq)
            seq.state = SeqState.RUNNING
            self.running.append(seq)

    def _schedule_decodes(self) -> list[Sequence]:
        """Every running sequence past its prefill feeds its last token, oldest first."""
        decodes: list[Sequence] = []
        scheduled: set[int] = set()
        for seq in list(self.running):
            if seq.state is not SeqState.RUNNING or seq.is_prefilling:
                continue  # preempted by an older one just now, or still prefilling
            if seq.ends_ahead(self.max_model_len):
                continue  # its pending tokens end it: the step that reads them back finishes it
            while not self._can_append(seq):
                victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
                self.preempt(victim)  # the youngest not yet scheduled (this one, at worst)
                if victim is seq:
                    break
            else:
                if seq.num_cached // self.block_size == len(seq.block_table):
                    seq.block_table += self.allocator.allocate(1)
                decodes.append(seq)
                scheduled.add(id(seq))
        return decodes

    def _can_append(self, seq: Sequence) -> bool:
        # the token fed next lands at position num_cached
        return seq.num_cached // self.block_size < len(seq.block_table) or self.allocator.can_allocate(1)

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and queue it first for recomputation (tokens still on
        the device are dropped: the recompute samples them again, the same ones)."""
        self.num_preemptions += 1
        self.running.remove(seq)
        self._free_blocks(seq)
        seq.num_cached = 0
        seq.num_pending = 0
        seq.generation += 1
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
        self.allocator.free(seq.block_table[::-1])  # the tail is evicted before the head
        seq.block_table = []
        seq.num_registered = 0
