"""Launching a step and reading it back: the device part of ``Engine.step``, and the outputs that
end a request (a failure, a prefill engine's result with its lease).

``launch`` runs a batch's forward pass and samples its rows on the device, moves the host state on
as if the step had run (``num_cached``; each sampling row gets a pending token), and starts the one
device-to-host copy of the step: the sampled ids, with their log probabilities' bits. ``InFlight``
is the launched step; ``read`` waits for that copy (the step's only synchronisation).

Overlapped scheduling launches step N+1 before reading step N back, so the host schedules and
prepares N+1 while the device runs N: N+1 feeds N's tokens straight from the device. Blocks freed
meanwhile may be reused at once by later steps (the device runs them in order); only a block
handed to a transfer must wait until the device has stopped writing it (``InFlight.wait``, which
``Engine.reserve`` calls).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from moriio_ray.engine.admission import request_error
from moriio_ray.engine.batch import Batch, PrefillChunk
from moriio_ray.engine.block_allocator import BlockAllocator
from moriio_ray.engine.device import Completion
from moriio_ray.engine.grammar import Constraints, apply_bitmask
from moriio_ray.engine.outputs import PrefillResult, StepOutput
from moriio_ray.engine.runner import ModelRunner
from moriio_ray.engine.sampler import SamplingRow, row_key, sample_each_device
from moriio_ray.engine.sequence import Sequence, blocks_for
from moriio_ray.engine.shaping import apply_shaping, plan_shaping

# a token's alternatives: (token id, raw log probability) pairs, most likely first
TopLogprobs = list[tuple[int, float]]

log = logging.getLogger(__name__)

ChunkHook = Callable[[int, list[PrefillChunk]], None]


@dataclasses.dataclass
class Row:
    """A sampling row of a launched step."""

    seq: Sequence
    generation: int  # the sequence's at launch: a preempted sequence's rows are stale
    error: BaseException | None = None  # its sampling failed (the sequence ended at launch)


@dataclasses.dataclass
class InFlight:
    """A launched step whose sampled tokens the host has not read yet."""

    rows: list[Row]
    tokens: torch.Tensor | None  # [R] int64 on the device: the next step's inputs read it
    # [2 + 2k, R] int32 (pinned on CUDA): token ids, log-probability bits, then the k alternatives'
    # ids and their log-probability bits
    host: torch.Tensor | None
    event: Completion | None  # None: the step had run when ``launch`` returned (the CPU)
    want_logprobs: bool
    num_top: int = 0  # k
    aborted: set[str] = dataclasses.field(default_factory=set)  # meanwhile: no output for them

    def wait(self) -> None:
        """Until the device has run the step (and its copy back): none of its writes is pending."""
        if self.event is not None:
            self.event.synchronize()

    def read(self) -> tuple[list[int], list[float] | None, list[TopLogprobs] | None]:
        """The sampled ids and (if any row asked) log probabilities and alternatives per row, once
        the copy has landed."""
        if self.host is None:
            return [], None, None
        self.wait()
        tokens: list[int] = self.host[0].tolist()
        logprobs: list[float] | None = (
            self.host[1].view(torch.float32).tolist() if self.want_logprobs else None
        )
        if not self.num_top:
            return tokens, logprobs, None
        k = self.num_top
        ids: list[list[int]] = self.host[2 : 2 + k].T.tolist()  # [R][k]
        values: list[list[float]] = self.host[2 + k :].view(torch.float32).T.tolist()
        tops = [list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]
        return tokens, logprobs, tops


def sampling_row(seq: Sequence) -> SamplingRow:
    """The row that samples ``seq``'s next token (its output position counts the pending ones)."""
    p = seq.params
    position = seq.sample_offset + len(seq.output_ids) + seq.num_pending
    key = row_key(seq.seed, position) if p.temperature > 0 else 0
    return SamplingRow(p.temperature, p.top_k, p.top_p, key, p.logprobs or p.top_logprobs > 0, p.top_logprobs)


def launch(
    batch: Batch,
    runner: ModelRunner,
    *,
    hook: ChunkHook | None,
    prev_tokens: torch.Tensor | None,
    on_failure: Callable[[Sequence], None],
    eos_ids: list[int] | tuple[int, ...] = (),
    constraints: Constraints | None = None,
) -> InFlight:
    """Run ``batch`` and sample it on the device; ``on_failure`` ends a sequence whose own
    sampling failed, at once."""
    chunks = batch.prefill_chunks() if hook is not None and batch.num_decodes < len(batch.seqs) else []
    layer_hook = (lambda i: hook(i, chunks)) if hook is not None and chunks else None
    sampled = [seq for seq, s in zip(batch.seqs, batch.samples(), strict=True) if s]
    sampling = [sampling_row(seq) for seq in sampled]
    shaping = plan_shaping(sampled, eos_ids)  # before the pending counts move on
    masks = constraints.masks(sampled) if constraints is not None and shaping is not None else None
    keep = _prompt_rows(batch)
    logits = runner.run(batch, layer_hook, prev_tokens, keep)  # [R, vocab]
    if keep:
        _prompt_logprobs(batch, keep, runner)
    raw = logits
    if shaping is not None:  # the log probabilities stay those of the raw logits
        want_raw = any(r.want_logprob for r in sampling)
        logits = apply_shaping(logits.clone() if want_raw else logits, shaping, prev_tokens)
        if masks is not None:
            apply_bitmask(logits, masks[1], masks[0])
    rows = [Row(seq, seq.generation) for seq in sampled]
    for seq, n in zip(batch.seqs, batch.q_lens, strict=True):
        seq.num_cached += n  # the host moves on as if the step had run
    if not sampled:  # nothing to read back, but a reservation may still wait for the step's writes
        return InFlight(rows, None, None, runner.completion(), False)
    out, errors = sample_each_device(logits, sampling, raw)
    tokens, logprobs = out.tokens, out.logprobs
    for i, (row, error) in enumerate(zip(rows, errors, strict=True)):
        if error is not None:
            row.error = error
            on_failure(row.seq)
        else:
            row.seq.num_pending += 1
            row.seq.pending_row = i
    # the one copy back of the step: ids and log-probability bits side by side, as int32
    bits = logprobs.view(torch.int32) if logprobs is not None else torch.zeros_like(tokens, dtype=torch.int32)
    parts = [tokens.to(torch.int32)[None], bits[None]]
    num_top = 0
    if out.top_ids is not None and out.top_logprobs is not None:
        num_top = out.top_ids.shape[1]
        parts += [out.top_ids.T.to(torch.int32), out.top_logprobs.T.contiguous().view(torch.int32)]
    host, event = runner.copy_back(torch.cat(parts))  # [2 + 2k, R]
    return InFlight(rows, tokens, host, event, logprobs is not None, num_top)


def _prompt_rows(batch: Batch) -> dict[int, torch.Tensor] | None:
    """The prefill rows whose prompt logprobs are asked for (and not yet all computed)."""
    rows = {
        i: torch.empty(0)
        for i in range(batch.num_decodes, len(batch.seqs))
        if batch.seqs[i].params.prompt_logprobs is not None
        and batch.seqs[i].num_cached < batch.seqs[i].num_prompt_tokens
    }
    return rows or None


def _prompt_logprobs(batch: Batch, hidden: dict[int, torch.Tensor], runner: ModelRunner) -> None:
    """Each kept row's prompt tokens' log probabilities, appended to its sequence (read back now)."""
    for row, states in hidden.items():
        seq = batch.seqs[row]
        k = seq.params.prompt_logprobs or 0
        start = seq.num_cached  # not moved on yet: the chunk feeds [start, start + q_len)
        end = min(start + batch.q_lens[row], seq.num_prompt_tokens)  # prompt tokens fed so far
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [(None, [])]  # the first token: nothing precedes it
        # position j predicts token j + 1; tokens computed before (a recompute) are not again
        first = max(start + 1, len(seq.prompt_logprobs))
        targets = seq.prompt_ids[first : end + 1]  # the chunk's last position predicts token `end`
        if not targets:
            continue
        states = states[first - 1 - start : first - 1 - start + len(targets)]  # [T, hidden]
        log_probs = runner.model.compute_logits(states).log_softmax(dim=-1)  # [T, V]
        target = torch.tensor(targets, device=log_probs.device)[:, None]
        chosen = log_probs.gather(1, target).squeeze(1).tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in targets]
        if k:
            values, ids = log_probs.topk(k, dim=-1)  # [T, k]
            tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
        seq.prompt_logprobs += list(zip(chosen, tops, strict=True))


def failure_output(seq: Sequence, exc: BaseException) -> StepOutput:
    """The output that ends a request whose own sampling or stop checks raised ``exc``."""
    log.warning("request %s failed in the engine: %r", seq.request_id, exc, exc_info=exc)
    error = request_error(seq.request_id, exc)
    return StepOutput(
        request_id=seq.request_id, new_token_ids=[], finished=True, error=(type(error).__name__, str(error))
    )


def prefill_result(
    allocator: BlockAllocator,
    seq: Sequence,
    block_size: int,
    first_token: int,
    first_logprob: float | None,
    lease_s: float,
    finish_reason: str | None,
    first_top_logprobs: TopLogprobs | None = None,
) -> PrefillResult:
    """A prefill engine's result, its prompt's blocks leased for ``lease_s``; a first token that
    already ends the request (``finish_reason``) leaves nothing to read and leases nothing."""
    block_ids: list[int] = []
    deadline_unix = 0.0
    if finish_reason is None:
        block_ids = seq.block_table[: blocks_for(seq.num_prompt_tokens, block_size)]
        allocator.lease(seq.request_id, block_ids, time.monotonic() + lease_s)
        deadline_unix = time.time() + lease_s
    return PrefillResult(
        block_ids=list(block_ids),
        num_tokens=seq.num_prompt_tokens,
        first_token=first_token,
        lease_deadline_unix=deadline_unix,
        first_logprob=first_logprob,
        num_cached_tokens=seq.num_hit_tokens,
        first_top_logprobs=first_top_logprobs,
    )
