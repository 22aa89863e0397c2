"""Engine: the model, its paged KV cache and the continuous-batching step loop, in one of three roles.

- ``colocated``: ``add_request`` prefills, then decodes until a stop condition.
- ``prefill``: ``add_request`` prefills and samples the first token; the prompt's blocks stay leased
  under ``transfer_id == request_id`` for a peer to read, until ``release`` or lease + grace expiry.
- ``decode``: ``reserve`` allocates blocks for a prompt whose KV a transfer writes into ``kv_cache``;
  ``start_decode`` then joins the request to continuous batching after its first token, which the
  prefill engine sampled and its caller already has: a decode engine emits only the tokens it samples.

A step runs every running decode and prefill chunks up to ``max_num_batched_tokens`` (``scheduler``),
so a long prompt spans several steps while the running requests go on decoding. With overlapped
scheduling (``engine.overlap_scheduling``) ``step`` launches the next step before it reads the
previous one back: its outputs lag one step, with exactly the tokens of synchronous steps.

Every public method holds one lock, so a runtime may drive ``step`` from a worker thread while
another thread calls ``release`` or ``abort``.

Under tensor parallelism (``tp``) this engine is rank 0: it schedules, broadcasts each batch to the
other ranks (``RankEngine``, one message per step), runs its own shard and samples.

Fault isolation: an exception that one request causes in ``step`` (its sampling, its stop checks)
ends that request alone, with a ``StepOutput`` carrying the typed error, and frees its blocks; the
others go on. An exception outside those per-request parts (the model's forward: a device error,
out of memory) escapes ``step``: the engine itself has failed.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import msgspec
import torch

from moriio_ray.config import EngineConfig, ModelConfig
from moriio_ray.engine.admission import check_request, new_sequence
from moriio_ray.engine.block_allocator import BlockAllocator
from moriio_ray.engine.grammar import Constraints
from moriio_ray.engine.outputs import PromptLogprobs, StepOutput
from moriio_ray.engine.pd_role import LayerHook, PDRole
from moriio_ray.engine.rank import build_rank
from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.engine.scheduler import Scheduler
from moriio_ray.engine.sequence import SeqState, Sequence
from moriio_ray.engine.stepping import InFlight, TopLogprobs, failure_output, launch, prefill_result
from moriio_ray.engine.stopping import check_stop
from moriio_ray.engine.tokenizer import load_tokenizer
from moriio_ray.engine.tp import SINGLE, TPGroup
from moriio_ray.engine.tp_steps import Kind, StepChannel, StepMsg, encode_batch
from moriio_ray.errors import ConfigError

if TYPE_CHECKING:
    from moriio_ray.transfer.base import TransferAgent

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "colocated")


def _prompt_logprobs(seq: Sequence) -> PromptLogprobs | None:
    if seq.prompt_logprobs is None:
        return None
    return PromptLogprobs([lp for lp, _ in seq.prompt_logprobs], [top for _, top in seq.prompt_logprobs])


class Engine(PDRole):
    """A Llama/Qwen-family engine over a paged KV cache (see the module docstring for the roles)."""

    def __init__(
        self,
        model: ModelConfig,
        engine: EngineConfig,
        *,
        role: str,
        agent: TransferAgent | None = None,
        lease_grace_s: float = 5.0,
        lease_s: float = 30.0,
        cuda_graphs: bool = True,
        tp: TPGroup = SINGLE,
    ) -> None:
        if role not in ROLES:
            raise ConfigError(f"role: {role!r} is not one of {', '.join(ROLES)}")
        self.role = role
        self.lease_s = lease_s
        self.lease_grace_s = lease_grace_s
        if not tp.is_leader:
            raise ConfigError(f"tp: an Engine is rank 0 of its group; rank {tp.rank} runs a RankEngine")
        parts = build_rank(model, engine, role=role, agent=agent, tp=tp, cuda_graphs=cuda_graphs)
        self.device, self.dtype, self.args = parts.device, parts.dtype, parts.args
        self.max_model_len = parts.max_model_len
        self.model = parts.model
        self.tokenizer = load_tokenizer(model)
        self.cache = parts.cache
        self.kv_cache: torch.Tensor = self.cache.tensor
        self.kv_mem = self.cache.mem
        self.layout = self.cache.layout
        self.block_size = engine.block_size
        self.allocator = BlockAllocator(parts.num_blocks, prefix_caching=engine.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.allocator, engine.block_size, engine.max_num_seqs, engine.max_num_batched_tokens,
            self.max_model_len, engine.chunked_prefill,
        )  # fmt: skip
        overlap = engine.overlap_scheduling
        # overlapped steps feed sampled tokens from the device, which a follower rank cannot see
        self.overlap = (parts.runner.asynchronous if overlap is None else overlap) and tp.size == 1
        self._in_flight: InFlight | None = None  # overlap: the launched step not yet read back
        self.graphs = parts.graphs
        self.runner = parts.runner
        self.tp = tp
        # the other ranks' step messages (None at TP = 1: no message, no collective)
        self._steps = StepChannel(tp) if tp.size > 1 else None
        self._seqs: dict[str, Sequence] = {}
        self._pending: list[StepOutput] = []  # outputs produced outside step(), returned by the next one
        self._layer_hook: LayerHook | None = None
        self.constraints = Constraints(self.tokenizer, self.args.vocab_size)  # structured output
        self._lock = threading.RLock()

    # -- admission ------------------------------------------------------------------------------

    def _check_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if params.response_format is not None:
            self.constraints.check(params.response_format)  # InvalidRequest: the grammar fails
        in_use = request_id in self._seqs or self.allocator.get_lease(request_id) is not None
        check_request(
            request_id,
            prompt,
            params,
            in_use=in_use,
            vocab_size=self.args.vocab_size,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_blocks=self.allocator.num_blocks,
            prefill_only=self.role == "prefill",
        )

    def _new_seq(
        self, request_id: str, prompt: list[int], params: SamplingParams, sample_offset: int
    ) -> Sequence:
        seq = new_sequence(request_id, prompt, params, sample_offset, prefill_only=self.role == "prefill")
        self._seqs[request_id] = seq
        return seq

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        lease_s: float | None = None,
        sample_offset: int = 0,
    ) -> None:
        """Queue a request: prefill (and, unless the role is prefill, decode) it in later steps.

        On a prefill engine its blocks are leased for ``lease_s`` (default: the engine's) after the
        prefill. ``sample_offset``: output positions a continued request already produced (its
        seeded sampling goes on from there). Raises CapacityError when it can never fit,
        InvalidRequest for bad input.
        """
        with self._lock:
            self._check_request(request_id, prompt_token_ids, params)
            seq = self._new_seq(request_id, prompt_token_ids, params, sample_offset)
            seq.lease_s = lease_s
            self.scheduler.add(seq)

    # -- the step loop --------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one step: every running decode and prefill chunks up to the token budget. Returns
        the outputs of this step, or (overlapped scheduling) of the step before, which the host
        reads back while the device runs this one."""
        with self._lock:
            outputs, self._pending = self._pending, []
            if self._in_flight is not None and self._constrained():
                # a grammar's mask needs the previous token on the host: no overlap meanwhile
                outputs += self._read_back(self._in_flight)
                self._in_flight = None
            batch = self.scheduler.schedule()
            launched = None
            if batch is not None:
                if self._steps is not None:
                    self._steps.send(encode_batch(batch))  # the other ranks run the same batch
                prev = self._in_flight.tokens if self._in_flight is not None else None
                launched = launch(
                    batch,
                    self.runner,
                    hook=self._layer_hook,
                    prev_tokens=prev,
                    on_failure=self._drop,
                    eos_ids=self.tokenizer.eos_token_ids,
                    constraints=self.constraints,
                )
                for seq in batch.seqs:  # their KV is computed (queued on the device, in order)
                    self.scheduler.register_computed(seq)
            done, self._in_flight = (self._in_flight, launched) if self.overlap else (launched, None)
            if done is not None:
                outputs += self._read_back(done)
            return outputs

    def _constrained(self) -> bool:
        return any(s.params.response_format is not None for s in self.scheduler.running)

    def _read_back(self, done: InFlight) -> list[StepOutput]:
        """The outputs of a launched step: its tokens appended, stop checks, finished requests."""
        tokens, logprobs, tops = done.read()
        outputs = []
        for i, row in enumerate(done.rows):
            seq = row.seq
            if row.error is not None:  # its sampling failed at launch, which ended it
                if seq.request_id not in done.aborted:
                    outputs.append(failure_output(seq, row.error))
            elif seq.generation == row.generation and seq.state is SeqState.RUNNING:
                seq.num_pending -= 1
                logprob = logprobs[i] if logprobs is not None else None
                outputs.append(self._advance(seq, tokens[i], logprob, tops[i] if tops is not None else None))
            # else: preempted (it samples this token again), aborted, or finished by an earlier token
        return outputs

    def _advance(
        self, seq: Sequence, token: int, logprob: float | None, top: TopLogprobs | None
    ) -> StepOutput:
        seq.output_ids.append(token)
        want = seq.params.logprobs or seq.params.top_logprobs > 0
        logprob = logprob if want else None
        top = top[: seq.params.top_logprobs] if top is not None and seq.params.top_logprobs else None
        try:
            reason = check_stop(seq, self.tokenizer, self.max_model_len)
        except Exception as exc:  # this request's stop rule failed: end it alone
            return self._fail(seq, exc)
        out = StepOutput(
            request_id=seq.request_id,
            new_token_ids=[token],
            finished=reason is not None,
            finish_reason=reason,
            logprobs=[logprob] if logprob is not None else None,
            num_cached_tokens=seq.num_hit_tokens if len(seq.output_ids) == 1 else 0,
            top_logprobs=[top] if top is not None else None,
            prompt_logprobs=_prompt_logprobs(seq) if len(seq.output_ids) == 1 else None,
        )
        if seq.prefill_only:
            # a first token that already ends the request leaves nothing for a peer to read
            lease_s = self.lease_s if seq.lease_s is None else seq.lease_s
            out.prefill = prefill_result(
                self.allocator, seq, self.block_size, token, logprob, lease_s, reason, top
            )
            out.prefill = msgspec.structs.replace(out.prefill, prompt_logprobs=out.prompt_logprobs)
            out.finished = True
        if out.finished:
            self.scheduler.finish(seq)
            del self._seqs[seq.request_id]
        return out

    def _fail(self, seq: Sequence, exc: BaseException) -> StepOutput:
        """End one request that faulted inside ``step`` with a typed error; free its blocks."""
        self._drop(seq)
        return failure_output(seq, exc)

    @property
    def lock(self) -> threading.RLock:
        """The lock every public method holds; a caller may try it to run a call without waiting."""
        return self._lock

    def has_work(self) -> bool:
        """Whether ``step`` has anything to do: outputs to hand out, a step to read back, or a
        batch to run.

        False while the only queued prompts wait for blocks that leases hold: a ``release``, an
        ``abort`` or ``sweep_leases`` is what frees them, so a driver can sleep until one of those.
        """
        with self._lock:
            return bool(self._pending) or self._in_flight is not None or self.scheduler.can_schedule()

    # -- freeing --------------------------------------------------------------------------------

    def _drop(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self._seqs.pop(seq.request_id, None)

    def abort(self, request_id: str) -> None:
        """Forget a request wherever it is and free its blocks and lease at once (idempotent).

        No StepOutput follows for it; the caller reports the abort.
        """
        with self._lock:
            seq = self._seqs.get(request_id)
            if seq is not None:
                self._drop(seq)
            self.allocator.release(request_id)
            self._pending = [o for o in self._pending if o.request_id != request_id]
            if self._in_flight is not None:
                self._in_flight.aborted.add(request_id)

    # -- introspection --------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Exact counters: blocks (free, used, leased, total) and requests (running, waiting, reserved)."""
        with self._lock:
            return {
                "num_free_blocks": self.allocator.num_free,
                "num_used_blocks": self.allocator.num_used,
                "num_leased_blocks": self.allocator.num_leased,
                "num_blocks": self.allocator.num_blocks,
                "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                "num_reserved": sum(s.state is SeqState.RESERVED for s in self._seqs.values()),
                "num_preemptions": self.scheduler.num_preemptions,
            }

    def prefix_cache_stats(self) -> dict[str, int]:
        """Prefix caching: cached blocks (referenced or parked), and prompt tokens looked up and
        found cached at their requests' first admission (reservations on a decode engine included)."""
        with self._lock:
            return {
                "num_cached_blocks": self.allocator.num_cached,
                "num_queried_tokens": self.scheduler.num_queried_tokens,
                "num_hit_tokens": self.scheduler.num_hit_tokens,
            }

    def capture_graphs(self) -> int:
        """Capture every decode CUDA graph now (workers do, before serving); how many there are."""
        with self._lock:
            if self._steps is not None:
                self._steps.send(StepMsg(Kind.CAPTURE))  # every rank captures the same graphs
            return self.graphs.capture_all() if self.graphs is not None else 0

    def close(self) -> None:
        """Deregister the KV cache from the agent (the agent is the caller's to close); the other
        ranks of a tensor-parallel engine leave their loops."""
        with self._lock:
            if self._in_flight is not None:
                self._read_back(self._in_flight)
                self._in_flight = None
            if self._steps is not None:
                self._steps.send(StepMsg(Kind.STOP))
                self._steps = None
            self.cache.close()
