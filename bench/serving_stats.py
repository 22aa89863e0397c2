"""The serving benchmark's pure parts: per-request records, the request schedule, percentiles,
cell summaries, ratios to the bare engine, and the time budget.

No torch, no Ray: the HTTP client processes import this module too.

Times in a ``Record`` are ``time.perf_counter()`` readings. On Linux that clock is CLOCK_MONOTONIC,
which every process of the host shares, so records from several client processes line up.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Any

import msgspec


class Record(msgspec.Struct, kw_only=True):
    """What the client saw of one request (absolute perf_counter seconds; 0.0 where it never happened)."""

    index: int  # position in the cell's schedule
    sent_s: float = 0.0
    first_s: float = 0.0  # arrival of the first token
    last_s: float = 0.0  # arrival of the last token
    done_s: float = 0.0  # the stream ended
    num_tokens: int = 0
    num_chunks: int = 0  # token-carrying messages (SSE events, stream events, engine outputs)
    status: int = 0  # HTTP status; 200 for the in-process systems
    error: str | None = None

    def add_tokens(self, now_s: float, num_tokens: int) -> None:
        """Book a message of ``num_tokens`` tokens that arrived at ``now_s``."""
        if self.num_tokens == 0:
            self.first_s = now_s
        self.last_s = now_s
        self.num_tokens += num_tokens
        self.num_chunks += 1

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and self.num_tokens > 0

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for a one-token request."""
        if self.num_tokens < 2:
            return None
        return (self.last_s - self.first_s) / (self.num_tokens - 1)

    @property
    def tok_s(self) -> float:
        """This request's output tokens per second of its own life (send to last token)."""
        return self.num_tokens / (self.last_s - self.sent_s) if self.last_s > self.sent_s else 0.0


def describe(exc: BaseException) -> str:
    """An exception as one line for the report: its type and message (Ray's carry the remote cause)."""
    return f"{type(exc).__name__}: {exc}".replace("\n", " | ")[:500]


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0 <= q <= 1) with linear interpolation between order statistics; None if empty."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q: {q!r} must be in [0, 1]")
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def num_requests(concurrency: int, factor: int, minimum: int) -> int:
    """Requests in a cell: ``factor`` waves of ``concurrency``, at least ``minimum``."""
    if concurrency < 1 or factor < 1 or minimum < 1:
        raise ValueError("concurrency, factor and minimum must be >= 1")
    return max(factor * concurrency, minimum)


def schedule(count: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``count`` prompts of exactly ``prompt_len`` token ids, the same for every system of a run.

    Ids stay below 256 so that they are valid for every preset (the byte tokenizer included); the
    stream depends only on (seed, prompt_len, count).
    """
    if count < 0 or prompt_len < 1:
        raise ValueError("count must be >= 0 and prompt_len >= 1")
    rng = random.Random(f"{seed}:{prompt_len}:{count}")
    top = min(vocab_size, 256)
    return [[rng.randrange(top) for _ in range(prompt_len)] for _ in range(count)]


def _stats(values: list[float]) -> dict[str, float | None]:
    return {
        "p50": percentile(values, 0.50),
        "p99": percentile(values, 0.99),
        "mean": statistics.fmean(values) if values else None,
    }


def summarize(records: list[Record], expected_tokens: int) -> dict[str, Any]:
    """One cell's headline numbers from its records.

    ``output_tok_s`` is every completed request's tokens over the span from the first send to the
    last token. A request that ended with fewer than ``expected_tokens`` tokens counts as an error.
    """
    short = [r for r in records if r.error is None and r.status == 200 and r.num_tokens != expected_tokens]
    for r in short:
        r.error = f"got {r.num_tokens} tokens, expected {expected_tokens}"
    ok = [r for r in records if r.ok]
    tokens = sum(r.num_tokens for r in ok)
    span_s = max((r.last_s for r in ok), default=0.0) - min((r.sent_s for r in records), default=0.0)
    errors = sorted({f"{r.status}: {r.error}" for r in records if not r.ok})
    chunks = sum(r.num_chunks for r in ok)
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(records) - len(ok),
        "errors": errors[:5],
        "output_tokens": tokens,
        "span_s": span_s,
        "output_tok_s": tokens / span_s if span_s > 0 else 0.0,
        "tokens_per_chunk": tokens / chunks if chunks else None,
        "ttft_s": _stats([r.ttft_s for r in ok]),
        "tpot_s": _stats([t for r in ok if (t := r.tpot_s) is not None]),
        "request_tok_s": _stats([r.tok_s for r in ok]),
    }


def relative(records: list[Record]) -> list[list[Any]]:
    """The raw numbers of a cell for the JSON: one row per request, seconds from the cell's first send.

    Row: index, sent, ttft, tpot (None for one token), last token, tokens, chunks, status, error.
    """
    t0 = min((r.sent_s for r in records), default=0.0)
    rows: list[list[Any]] = []
    for r in sorted(records, key=lambda r: r.index):
        done = r.num_tokens > 0
        rows.append(
            [
                r.index,
                round(r.sent_s - t0, 6),
                round(r.ttft_s, 6) if done else None,
                round(t, 6) if (t := r.tpot_s) is not None else None,
                round(r.last_s - t0, 6) if done else None,
                r.num_tokens,
                r.num_chunks,
                r.status,
                r.error,
            ]
        )
    return rows


RAW_COLUMNS = ["index", "sent_s", "ttft_s", "tpot_s", "last_token_s", "tokens", "chunks", "status", "error"]


def ratios(cell: dict[str, Any], base: dict[str, Any] | None) -> dict[str, float | None]:
    """cell / base for tok/s, TPOT and TTFT p50/p99 (base: the bare engine at the same c and prompt)."""

    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    if base is None:
        return {}
    out: dict[str, float | None] = {"output_tok_s": div(cell["output_tok_s"], base["output_tok_s"])}
    for metric in ("tpot_s", "ttft_s"):
        for q in ("p50", "p99"):
            out[f"{metric}.{q}"] = div(cell[metric][q], base[metric][q])
    return out


def cell_budget_s(
    remaining_s: float, cells_left: int, reserved_s: float, drain_s: float, cap_s: float
) -> float:
    """How long the next cell may keep starting requests, so that the run ends within its budget.

    The time left after ``reserved_s`` (start-ups and warm-ups still to come) is shared evenly by
    the cells still to run; ``drain_s`` (how long the last cell ran past its box while its last
    requests finished) comes off each share. Never more than ``cap_s``, never under half a second.
    """
    if cells_left < 1:
        return cap_s
    share = (remaining_s - reserved_s) / cells_left - drain_s
    return max(0.5, min(cap_s, share))


def estimate_cell_s(
    concurrency: int,
    prompt_len: int,
    count: int,
    output_tokens: int,
    *,
    step_s: float,
    step_per_seq_s: float,
    prefill_tok_s: float,
) -> float:
    """A cell's expected wall time: ``count / concurrency`` waves, each a prefill of the wave's
    prompts and ``output_tokens - 1`` decode steps of ``step_s + concurrency * step_per_seq_s``."""
    waves = -(-count // concurrency)
    prefill_s = concurrency * prompt_len / prefill_tok_s
    decode_s = (output_tokens - 1) * (step_s + concurrency * step_per_seq_s)
    return waves * (prefill_s + decode_s)
