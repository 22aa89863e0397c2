"""A serving cell's numbers from its request records: the summary (TTFT, TPOT, tok/s, handoff
timings) and the raw rows kept in the JSON."""

from __future__ import annotations

from typing import Any

from bench.common import (
    stats,
)
from bench.http_client import Record

TIMINGS = ("handoff_s", "handoff_rpc_s", "handoff_local_s", "transfer_s", "push_wait_s", "transfer_bytes")


RAW_COLUMNS = ["index", "sent_s", "ttft_s", "tpot_s", "last_token_s", "tokens", "chunks", "status", "error"]


def summarize(records: list[Record], expected_tokens: int) -> dict[str, Any]:
    """A cell's numbers; a request that ended with another count than ``expected_tokens`` is an error.
    ``timings``: the Python API's handoff breakdown (seconds; bytes), where the requests carried it."""
    for r in records:
        if r.error is None and r.status == 200 and r.num_tokens != expected_tokens:
            r.error = f"got {r.num_tokens} tokens, expected {expected_tokens}"
    ok = [r for r in records if r.ok]
    tokens, chunks = sum(r.num_tokens for r in ok), sum(r.num_chunks for r in ok)
    span_s = max((r.last_s for r in ok), default=0.0) - min((r.sent_s for r in records), default=0.0)
    timings = {k: stats([v for r in ok if (v := (r.extra or {}).get(k)) is not None]) for k in TIMINGS}
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(records) - len(ok),
        "errors": sorted({f"{r.status}: {r.error}" for r in records if not r.ok})[:5],
        "output_tokens": tokens,
        "span_s": span_s,
        "output_tok_s": tokens / span_s if span_s > 0 else 0.0,
        "tokens_per_chunk": tokens / chunks if chunks else None,
        "ttft_s": stats([r.ttft_s for r in ok]),
        "tpot_s": stats([t for r in ok if (t := r.tpot_s) is not None]),
        "timings": {k: v for k, v in timings.items() if v["p50"] is not None},
    }


def raw_rows(records: list[Record]) -> list[list[Any]]:
    """One row per request (RAW_COLUMNS), seconds from the cell's first send."""
    t0 = min((r.sent_s for r in records), default=0.0)
    rows: list[list[Any]] = []
    for r in sorted(records, key=lambda r: r.index):
        times = [
            r.sent_s - t0,
            r.ttft_s if r.num_tokens else None,
            r.tpot_s,
            r.last_s - t0 if r.num_tokens else None,
        ]
        rounded = [None if t is None else round(t, 6) for t in times]
        rows.append([r.index, *rounded, r.num_tokens, r.num_chunks, r.status, r.error])
    return rows
