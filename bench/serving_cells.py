"""The serving benchmark's cells: a load (closed loop at c, or Poisson arrivals at a rate) of the same
prompts on one system, driven through the Python API (``python_cell``) or over HTTP (``http_cell``),
and a series of cells on one system (``run_series``) with each cell's CPU seconds per process. No
torch or Ray at import time."""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
import urllib.request
from collections.abc import Callable, Coroutine
from typing import Any

from bench import cpu_account
from bench import report as rep
from bench.common import describe, write_json
from bench.http_client import Record, drive, run_http_cell
from bench.http_client import arrivals as poisson
from bench.profiling import Profiler
from bench.serving_engine import Load
from bench.serving_stats import TIMINGS, raw_rows, summarize

Cell = Callable[[list[list[int]], Load], Coroutine[Any, Any, tuple[list[Record], dict[str, Any]]]]


# -- workloads -------------------------------------------------------------------------------------


def prompts(
    count: int, length: int, seed: int, long_fraction: float = 0.0, long_len: int = 512
) -> list[list[int]]:
    """``count`` prompts of token ids below 256 (valid for every preset), the same for every system:
    exactly ``length`` tokens each, or with ``long_fraction`` a mix of [len, 2 len] and long ones."""
    rng = random.Random(f"{seed}:{length}:{count}")
    pick = lambda: rng.randint(
        *((long_len, 2 * long_len) if rng.random() < long_fraction else (length, 2 * length))
    )
    lens = [pick() for _ in range(count)] if long_fraction else [length] * count
    return [[rng.randrange(256) for _ in range(n)] for n in lens]


def cell_requests(a: argparse.Namespace, load: Load) -> int:
    return max(a.requests, a.waves * int(load[1])) if load[0] == "c" else a.requests


def label(load: Load) -> str:
    return f"c={int(load[1])}" if load[0] == "c" else f"rate={load[1]:g}"


# -- statistics ------------------------------------------------------------------------------------


# -- the systems -----------------------------------------------------------------------------------


def python_cell(pipe: Any, a: argparse.Namespace, keep_tokens: bool = False) -> Cell:
    """Cells through ``pipe.stream``; each record keeps the last event's Timings and cached tokens."""
    from moriio_ray import SamplingParams

    params = SamplingParams(max_tokens=a.output_tokens, ignore_eos=True, temperature=0.0)

    async def one(slot: int, item: tuple[int, list[int]]) -> Record:
        rec = Record(index=item[0], sent_s=time.perf_counter(), status=200)
        last, ids, cached = None, list[int](), 0
        try:
            async with contextlib.aclosing(pipe.stream(token_ids=item[1], params=params)) as events:
                async for last in events:
                    if last.token_ids:
                        rec.add_tokens(time.perf_counter(), len(last.token_ids))
                        ids += last.token_ids if keep_tokens else []
                    cached = max(cached, last.num_cached_tokens or 0)
        except Exception as exc:  # one request's failure is recorded; the cell goes on
            rec.error = describe(exc)[:300]
        rec.done_s = time.perf_counter()
        t = getattr(last, "timings", None)
        rec.extra = {"cached_tokens": max(cached, getattr(t, "cached_tokens", None) or 0)}
        rec.extra |= {k: getattr(t, k, None) for k in TIMINGS} | ({"token_ids": ids} if keep_tokens else {})
        return rec

    def timed_out(slot: int, item: tuple[int, list[int]]) -> Record:
        now = time.perf_counter()
        return Record(index=item[0], sent_s=now, done_s=now, status=200, error="timeout")

    async def cell(prompts: list[list[int]], load: Load) -> tuple[list[Record], dict[str, Any]]:
        at_s = poisson(len(prompts), load[1], a.seed) if load[0] == "rate" else None
        items = list(enumerate(prompts))
        c = int(load[1]) if load[0] == "c" else 1
        return await drive(items, one, timed_out, timeout_s=a.request_timeout_s, concurrency=c, at_s=at_s), {}

    return cell


def http_cell(base_url: str, a: argparse.Namespace) -> Cell:
    fields = dict(max_tokens=a.output_tokens, stream=True, ignore_eos=True, temperature=0, logprobs=0)
    fields["stream_options"] = {"include_usage": True}  # the client checks usage against the tokens

    async def cell(prompts: list[list[int]], load: Load) -> tuple[list[Record], dict[str, Any]]:
        at_s = poisson(len(prompts), load[1], a.seed) if load[0] == "rate" else None
        bodies, c = [{"prompt": p, **fields} for p in prompts], int(load[1]) if load[0] == "c" else 1
        kw = {"at_s": at_s, "concurrency": c, "num_procs": a.client_procs, "timeout_s": a.request_timeout_s}
        records, client = await run_http_cell(base_url + "/v1/completions", bodies, **kw)
        return records, {"client": client}

    return cell


# -- profiles --------------------------------------------------------------------------------------


# -- the run ---------------------------------------------------------------------------------------


async def run_series(
    a: argparse.Namespace,
    report: dict[str, Any],
    series: str,
    cell: Cell,
    workers: dict[int, str] | None = None,
) -> None:
    """Warm up (unrecorded: --warmup requests, then one wave at the top concurrency, so that most CUDA
    graphs exist before the first measured cell), then every (prompt length, load) cell, each with
    the CPU seconds of every process by part (``workers``: the engines' pids and roles). With
    ``a.checkpoint`` (a path), the record so far is written there after every cell."""
    loads: list[Load] = [("c", c) for c in a.concurrency] + [("rate", r) for r in a.rates]
    top = max(a.concurrency, default=min(a.warmup, 8))
    for length in a.prompt_lens if a.warmup else []:
        await cell(prompts(a.warmup, length, a.seed + 1), ("c", max(1, min(a.warmup, top))))
        if top > a.warmup:
            await cell(prompts(top, length, a.seed + 2), ("c", top))
    profiler = Profiler(a.out / "profiles", series, a.profile_rate) if a.profile else None
    try:
        for length in a.prompt_lens:
            for load in loads:
                batch = prompts(cell_requests(a, load), length, a.seed, a.long_fraction, a.long_len)
                entry: dict[str, Any] = {"series": series, "load": label(load), "prompt_len": length}
                t0, cpu0, procs0 = time.perf_counter(), time.process_time(), cpu_account.take(workers)
                try:
                    records, extra = await cell(batch, load)
                    entry |= {"wall_s": time.perf_counter() - t0, "caller_cpu_s": time.process_time() - cpu0}
                    entry |= {
                        **extra,
                        "summary": summarize(records, a.output_tokens),
                        "raw": raw_rows(records),
                    }
                    entry["cpu_s"] = cpu_account.spent(procs0, cpu_account.take(workers))
                    if "client" in extra:  # its processes have ended: their own count
                        entry["cpu_s"]["client"] = sum(extra["client"]["cpu_s"])
                    entry["cpu_ms_per_1k_tokens"] = rep.cpu_per_1k(entry)
                except Exception as exc:  # one cell's failure is recorded; the run goes on
                    entry["error"] = describe(exc)
                report["cells"].append(entry)
                print(rep.cell_line(entry), flush=True)
                if getattr(a, "checkpoint", None) is not None:  # a run killed later keeps this cell
                    write_json(a.checkpoint, report)
    finally:
        if profiler is not None:
            report["profiles"][series] = profiler.stop()


def served_models(url: str) -> list[str]:
    """The model names a running server answers ``GET /v1/models`` with (it must be reachable)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        return [m["id"] for m in json.load(resp)["data"]]
