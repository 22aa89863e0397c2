"""One serving-benchmark run: its plan, its clock and time budget, the cells it books, and the loop
that runs one series (one system through one transport) cell by cell."""

from __future__ import annotations

import argparse
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench import serving_report
from bench.serving_stats import (
    Record,
    cell_budget_s,
    describe,
    estimate_cell_s,
    num_requests,
    ratios,
    relative,
    schedule,
    summarize,
)
from bench.serving_systems import PIPELINES

# Assumed costs (s) for the estimate and the budget, replaced by measured ones as the run goes.
STARTUP_S = {
    "cuda": {"engine": 40.0, "ray": 10.0, "launch": 45.0, "deploy": 10.0, "warmup": 5.0},
    "cpu": {"engine": 5.0, "ray": 12.0, "launch": 15.0, "deploy": 8.0, "warmup": 3.0},
}
# The bare engine's speed (bench/results/engine_*.json): a step takes a + c * b s; prefill tok/s.
SPEED = {"cuda": (2.3e-3, 1.6e-5, 230e3), "cpu": (0.5e-3, 6.5e-5, 85e3)}

# cell(prompts, concurrency, time box in s or None) -> (records, extra fields of the cell)
CellFn = Callable[[list[list[int]], int, "float | None"], Awaitable[tuple[list[Record], dict[str, Any]]]]


def http_series(modes: list[str], intervals: list[int]) -> list[tuple[str, str, int | None]]:
    """(label, serve mode, stream_interval or None for the config's) of each HTTP series: ``http``
    through Serve's default proxy, ``http-fast`` through HAProxy (see moriio_ray/serve/serve_mode.py),
    with ``-i<n>`` when several intervals are compared."""
    choices: list[int | None] = [*intervals] or [None]
    out = []
    for mode in modes:
        base = "http" if mode == "default" else f"http-{mode}"
        out += [(base if len(choices) < 2 else f"{base}-i{n}", mode, n) for n in choices]
    return out


def series_name(system: str, transport: str) -> str:
    return "engine" if system == "engine" else f"{system}/{transport}"


class Run:
    """The plan (``a``: the parsed flags), the clock, the configs, and the report being filled in."""

    def __init__(
        self, a: argparse.Namespace, device: str, configs: dict[str, dict[str, Any]], t0: float
    ) -> None:
        self.a, self.device, self.configs = a, device, configs
        self.t0 = t0  # perf_counter at the start of the process
        self.startup = dict(STARTUP_S[device])
        # (label, serve mode, stream_interval) of each HTTP series
        self.http = http_series(a.serve_modes, a.stream_intervals) if "http" in a.transports else []
        transports = (["python"] if "python" in a.transports else []) + [h[0] for h in self.http]
        self.series = [("engine", "python")] if "engine" in a.systems else []
        self.series += [(s, t) for s in PIPELINES if s in a.systems for t in transports]
        self.grid = [(c, length) for length in a.prompt_lens for c in a.concurrency]
        self.cells_left = len(self.series) * len(self.grid)
        self.warmups_left = len(self.series)
        self.drain_s = 0.0  # how long the series' last cell ran past its box
        self.cells: list[dict[str, Any]] = []
        self.engine_cells: dict[tuple[int, int], dict[str, Any]] = {}
        self.done: set[str] = set()  # systems whose start-up is behind us
        self.report: dict[str, Any] = {"startup_s": {}}
        self.vocab_size = 256

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t0

    def startups_left_s(self) -> float:
        pipes = [s for s in PIPELINES if s in self.a.systems and s not in self.done]
        total = len(pipes) * (self.startup["launch"] + len(self.http) * self.startup["deploy"])
        if "engine" in self.a.systems and "engine" not in self.done:
            total += self.startup["engine"]
        if pipes and "ray" not in self.done:  # ray.init and serve.start
            total += self.startup["ray"]
        return total + self.warmups_left * self.startup["warmup"]

    def can_start(self, kind: str) -> bool:
        """Whether a start-up of ``kind`` (launch, deploy) still fits the budget with one cell after it."""
        return self.elapsed_s() + self.startup[kind] + self.startup["warmup"] + 1.0 < self.a.budget_s

    def soft_s(self) -> float | None:
        """The next cell's time box, or None when the budget is spent (the cell is skipped)."""
        remaining = self.a.budget_s - self.elapsed_s()
        if remaining <= 0:
            return None
        reserved = self.startups_left_s()
        return cell_budget_s(remaining, self.cells_left, reserved, self.drain_s, self.a.max_cell_s)

    def estimate_s(self, slowdown: float) -> float:
        """The whole run's expected seconds with pipelines ``slowdown`` times slower than the engine."""
        step_s, per_seq_s, prefill_tok_s = SPEED[self.device]
        total = self.startups_left_s()
        for system, _ in self.series:
            factor = 1.0 if system == "engine" else slowdown
            for c, length in self.grid:
                n = num_requests(c, self.a.requests_factor, self.a.min_requests)
                cell_s = estimate_cell_s(
                    c,
                    length,
                    n,
                    self.a.output_tokens,
                    step_s=step_s * factor,
                    step_per_seq_s=per_seq_s * factor,
                    prefill_tok_s=prefill_tok_s,
                )
                drain_s = self.a.output_tokens * (step_s + c * per_seq_s) * factor  # the last wave
                total += min(cell_s, self.a.max_cell_s + drain_s) + 0.5  # + client start, summary
        return total

    def record(
        self, system: str, transport: str, c: int, length: int, planned: int, soft: float | None, **extra: Any
    ) -> dict[str, Any]:
        """Book one cell (``extra``: records, wall_s, error, client or caller CPU) and print its line."""
        self.cells_left -= 1
        records = extra.pop("records", None)
        cell: dict[str, Any] = {
            "series": series_name(system, transport),
            "system": system,
            "transport": transport,
            "concurrency": c,
            "prompt_len": length,
            "planned_requests": planned,
            "cell_budget_s": soft,
            **extra,
        }
        if records is not None:
            summary = summarize(records, self.a.output_tokens)
            cell["summary"] = summary
            cell["budget_limited"] = summary["num_requests"] < planned
            cell["raw"] = relative(records)
            if system == "engine":
                self.engine_cells[(c, length)] = summary
            cell["ratio_to_engine"] = ratios(summary, self.engine_cells.get((c, length)))
        self.cells.append(cell)
        print(serving_report.cell_line(cell), flush=True)
        return cell

    def fail_series(self, system: str, transport: str, error: str) -> None:
        """Book every cell of a series not yet booked (a failed launch or deploy) with ``error``."""
        name = series_name(system, transport)
        have = {(c["concurrency"], c["prompt_len"]) for c in self.cells if c["series"] == name}
        for c, length in self.grid:
            if (c, length) not in have:
                planned = num_requests(c, self.a.requests_factor, self.a.min_requests)
                self.record(system, transport, c, length, planned, None, error=error[:500])


async def run_series(run: Run, system: str, transport: str, cell: CellFn) -> None:
    """Warm up (unrecorded), then every cell of the grid through ``cell(prompts, c, time box)``.

    The warm-up, per prompt length: --warmup requests at that concurrency (small decode batches),
    then one wave at the largest concurrency (the large batches and the long contexts), so that
    most CUDA graphs, which are captured on first use, exist before the first measured cell.
    """
    a = run.a
    t0 = time.perf_counter()
    top = max(a.concurrency)
    for length in a.prompt_lens:
        await cell(schedule(a.warmup, length, run.vocab_size, a.seed + 1), min(a.warmup, top), None)
        await cell(schedule(top, length, run.vocab_size, a.seed + 2), top, None)
    run.warmups_left -= 1
    run.startup["warmup"] = time.perf_counter() - t0
    run.drain_s = 0.0
    for c, length in run.grid:
        prompts = schedule(num_requests(c, a.requests_factor, a.min_requests), length, run.vocab_size, a.seed)
        soft = run.soft_s()
        if soft is None:
            run.record(system, transport, c, length, len(prompts), soft, error="skipped: budget spent")
            continue
        t0, cpu0 = time.perf_counter(), time.process_time()
        try:
            records, extra = await cell(prompts, c, soft)
        except Exception as exc:  # one cell's failure is recorded; the run goes on
            run.record(system, transport, c, length, len(prompts), soft, error=describe(exc))
            continue
        wall_s = time.perf_counter() - t0
        run.drain_s = max(0.0, wall_s - soft)
        run.record(
            system,
            transport,
            c,
            length,
            len(prompts),
            soft,
            records=records,
            wall_s=wall_s,
            caller_cpu_s=time.process_time() - cpu0,
            **extra,
        )
