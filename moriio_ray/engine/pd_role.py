"""The engine's prefill/decode hand-over: a decode engine's reservations for injected KV, joining
them to the batch (or recomputing them when the transfer failed), a prefill engine's leases and the
per-layer hook that WRITE pushes from. ``Engine`` inherits these; they hold its one lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from moriio_ray.engine.admission import new_sequence, request_error
from moriio_ray.engine.batch import PrefillChunk
from moriio_ray.engine.block_allocator import BlockAllocator
from moriio_ray.engine.outputs import StepOutput
from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.engine.scheduler import Scheduler
from moriio_ray.engine.sequence import SeqState, Sequence, blocks_for
from moriio_ray.engine.stepping import InFlight
from moriio_ray.engine.stopping import check_stop
from moriio_ray.errors import InvalidRequest

if TYPE_CHECKING:
    from moriio_ray.engine.arch import ModelArgs
    from moriio_ray.engine.tokenizer import Tokenizer

LayerHook = Callable[[int, list[PrefillChunk]], None]


class PDRole:
    """Reservations, leases and the layer hook of an ``Engine`` (see the module docstring)."""

    role: str
    block_size: int
    max_model_len: int
    lease_grace_s: float
    args: ModelArgs
    tokenizer: Tokenizer
    allocator: BlockAllocator
    scheduler: Scheduler
    _lock: threading.RLock
    _seqs: dict[str, Sequence]
    _pending: list[StepOutput]
    _in_flight: InFlight | None
    _layer_hook: LayerHook | None

    if TYPE_CHECKING:

        def _check_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None: ...

        def _drop(self, seq: Sequence) -> None: ...

    # -- decode role ----------------------------------------------------------------------------

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        sample_offset: int = 0,
    ) -> list[int] | None:
        """Decode role: blocks for a prompt whose KV a transfer writes in; None if short right now.
        With prefix caching the first ``cached_blocks(request_id)`` of them already hold the
        prompt's KV (cached here): a transfer fills only the rest.
        With a step in flight (overlapped scheduling) it first waits until the device has run it."""
        with self._lock:
            if self.role == "prefill":
                raise InvalidRequest("reserve: a prefill engine takes no injected KV; use a decode engine")
            self._check_request(request_id, prompt_token_ids, params)
            seq = new_sequence(request_id, prompt_token_ids, params, sample_offset, prefill_only=False)
            # every full block of the prompt may be a hit: decoding writes from the prompt's end on
            hits = self.scheduler.cached_prefix(seq, seq.num_prompt_tokens)
            num_blocks = blocks_for(seq.num_prompt_tokens, self.block_size)
            if not self.scheduler.fits(seq, hits, num_blocks):
                return None
            if self._in_flight is not None:  # a freed block may still be written by the device
                self._in_flight.wait()
            self._seqs[request_id] = seq
            seq.state = SeqState.RESERVED
            self.scheduler.take_blocks(seq, hits, num_blocks)
            return list(seq.block_table)

    def cached_blocks(self, request_id: str) -> int:
        """Decode role: how many of a reservation's blocks (the first ones) held the prompt's KV
        already, from this engine's prefix cache; a transfer need not fill them."""
        with self._lock:
            return self._reserved(request_id).num_hit_tokens // self.block_size

    def _reserved(self, request_id: str) -> Sequence:
        seq = self._seqs.get(request_id)
        if seq is None or seq.state is not SeqState.RESERVED:
            raise InvalidRequest(f"request_id: {request_id!r} holds no reservation; call reserve first")
        return seq

    def start_decode(self, request_id: str, first_token: int) -> None:
        """Decode role: the reserved prompt's KV is in place; decode after ``first_token``.

        The first token is recorded, not emitted (its sampler and caller have it already); the
        following steps emit the tokens this engine samples.
        """
        with self._lock:
            seq = self._join(request_id, first_token)
            seq.num_cached = seq.num_prompt_tokens
            self.scheduler.register_computed(seq)  # the transfer has filled the prompt's blocks
            self._schedule_or_finish(seq)

    def recompute_reserved(self, request_id: str, first_token: int) -> None:
        """Decode role, the transfer failed: compute the prompt and ``first_token`` into the reserved
        blocks here (chunked like any prefill), then decode on; as with ``start_decode``, nothing is
        re-emitted."""
        with self._lock:
            seq = self._join(request_id, first_token)
            # the next prefill feeds prompt + first token past the cached blocks, and samples the second
            seq.num_cached = seq.num_hit_tokens
            self._schedule_or_finish(seq)

    def _join(self, request_id: str, first_token: int) -> Sequence:
        seq = self._reserved(request_id)
        is_int = isinstance(first_token, int) and not isinstance(first_token, bool)
        if not is_int or not 0 <= first_token < self.args.vocab_size:
            raise InvalidRequest(f"first_token: {first_token!r} is not a token id of this model")
        seq.output_ids = [first_token]
        return seq

    def _schedule_or_finish(self, seq: Sequence) -> None:
        try:
            reason = check_stop(seq, self.tokenizer, self.max_model_len)
        except Exception as exc:  # this request's stop rule failed: end it alone
            self._drop(seq)
            raise request_error(seq.request_id, exc) from exc
        if reason is None:
            self.scheduler.add(seq)
            return
        # the first token already ends it (the prefill engine reports that itself; kept for safety)
        self._drop(seq)
        self._pending.append(
            StepOutput(request_id=seq.request_id, new_token_ids=[], finished=True, finish_reason=reason)
        )

    # -- prefill role ---------------------------------------------------------------------------

    def release(self, transfer_id: str) -> bool:
        """Prefill role: a peer has read the blocks of ``transfer_id``; free them. False if unknown."""
        with self._lock:
            return self.allocator.release(transfer_id)

    def sweep_leases(self, now_s: float | None = None) -> list[str]:
        """Free leases whose deadline plus the grace period lies before ``now_s`` (monotonic clock)."""
        with self._lock:
            now = time.monotonic() if now_s is None else now_s
            return self.allocator.sweep(now, self.lease_grace_s)

    def set_layer_hook(self, hook: LayerHook | None) -> None:
        """Call ``hook(layer, chunks)`` in each step that prefills, right after that layer's K/V are
        written (queued on the device: on CUDA the engine does not synchronise; record an event).
        ``chunks``: a ``PrefillChunk`` per prefill row, the prompt tokens that step computed."""
        with self._lock:
            self._layer_hook = hook

    def prefill_blocks(self, request_id: str) -> list[int]:
        """The block ids holding a request's prompt KV (leased, being prefilled, or reserved)."""
        with self._lock:
            lease = self.allocator.get_lease(request_id)
            if lease is not None:
                return list(lease.block_ids)
            seq = self._seqs.get(request_id)
            if seq is None or not seq.block_table:
                raise InvalidRequest(f"request_id: {request_id!r} holds no blocks on this engine")
            return seq.block_table[: blocks_for(seq.num_prompt_tokens, self.block_size)]
