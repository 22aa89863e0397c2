"""The serving benchmark's text: one progress line per cell, the issue's goals, the Markdown tables."""

from __future__ import annotations

from typing import Any

HTTP_SERVER = {
    "inproc": {
        "kind": "inproc",
        "what": "Ray Serve in the benchmark's own Ray cluster, running the application that `serve run` "
        "builds from the same config (serve_apps/pd_openai.py); its ingress attaches to the pipeline "
        "that the Python-API cells launched, so the HTTP cells reuse those workers",
        "why": "a `serve run` child starts a second Ray cluster and launches the pipeline again; compare "
        "startup_s (*.deploy against serve_process_probe or *.serve_run)",
    },
    "process": {
        "kind": "process",
        "what": "the real `serve run` of each derived config in a child process with its own Ray cluster "
        "(moriio_ray/serve/process.py)",
        "why": "chosen by --http-server process",
    },
}

NOTES = [
    "closed loop: c requests in flight; a new one starts when one ends; the first wave starts at once",
    "output_tok_s: all tokens of completed requests over the span from the cell's first send to its last "
    "token; TTFT: send to first token; TPOT: (last token - first token) / (tokens - 1)",
    "times are client-side perf_counter readings (CLOCK_MONOTONIC, shared by the client processes)",
    "HTTP requests ask for logprobs (logprobs: 0, so that each SSE chunk tells its token count); the "
    "Python API and the bare engine do not",
    "a cell stops starting requests when its share of the run's budget is spent (budget_limited)",
]

GOAL_C, GOAL_LEN, LONG_LEN = 64, 128, 1024


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _x(ratio: float | None) -> str:
    return "" if ratio is None else f" ({ratio:.2f}x)"


def cell_line(cell: dict[str, Any]) -> str:
    head = f"[{cell['series']}] prompt {cell['prompt_len']} c={cell['concurrency']}:"
    summary = cell.get("summary")
    if summary is None:
        return f"{head} ERROR {cell.get('error')}"
    ratio = {} if cell["series"] == "engine" else cell.get("ratio_to_engine") or {}
    ttft, tpot = summary["ttft_s"], summary["tpot_s"]
    parts = [
        f"{summary['num_ok']}/{summary['num_requests']} ok (planned {cell['planned_requests']})",
        f"{summary['output_tok_s']:,.0f} tok/s{_x(ratio.get('output_tok_s'))}",
        f"TPOT p50 {_ms(tpot['p50'])} p99 {_ms(tpot['p99'])} ms{_x(ratio.get('tpot_s.p50'))}",
        f"TTFT p50 {_ms(ttft['p50'])} p99 {_ms(ttft['p99'])} ms{_x(ratio.get('ttft_s.p50'))}",
    ]
    if "client" in cell:
        parts.append(f"{summary['tokens_per_chunk'] or 0:.1f} tokens/event")
        parts.append(
            f"client CPU max {cell['client']['max_utilization']:.0%} of {cell['client']['procs']} procs"
        )
    elif cell.get("caller_cpu_s") is not None and cell.get("wall_s"):
        parts.append(f"driver CPU {cell['caller_cpu_s'] / cell['wall_s']:.0%}")
    parts.append(f"{cell.get('wall_s', 0.0):.1f} s")
    if summary["errors"]:
        parts.append(f"errors: {summary['errors'][0]}")
    return f"{head} " + ", ".join(parts)


def _find(report: dict[str, Any], series: str, c: int, length: int) -> dict[str, Any] | None:
    for cell in report.get("cells", []):
        if cell["series"] == series and cell["concurrency"] == c and cell["prompt_len"] == length:
            summary = cell.get("summary")
            return summary if summary and summary["num_ok"] else None
    return None


def _pick(values: list[int], want: int, fallback: int) -> int:
    return want if want in values else fallback


def http_goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 20's goals: each HTTP series against the same system's Python API, in one run."""
    grid, cells = report["grid"], report.get("cells", [])
    short = _pick(grid["prompt_lens"], GOAL_LEN, min(grid["prompt_lens"]))
    high = [c for c in (64, 128) if c in grid["concurrency"]] or [max(grid["concurrency"])]
    one, mid = min(grid["concurrency"]), _pick(grid["concurrency"], GOAL_C, max(grid["concurrency"]))
    decode = (report.get("engine_decode_only") or {}).get("decode_tok_s")
    out: list[dict[str, Any]] = []

    def add(measure: str, goal: str, value: float | None, met: bool | None) -> None:
        out.append({"issue": 20, "measure": measure, "goal": goal, "value": value, "met": met})

    for name in dict.fromkeys(c["series"] for c in cells if "/http" in c["series"]):
        base = name.split("/")[0] + "/python"
        for c in high:
            http, py = _find(report, name, c, short), _find(report, base, c, short)
            ratio = http["output_tok_s"] / py["output_tok_s"] if http and py else None
            add(f"{name} / {base} tok/s, c={c} prompt {short}", ">= 0.90", ratio, _at_least(ratio, 0.90))
        if name.startswith("colocated/") and decode and GOAL_C in grid["concurrency"]:
            http = _find(report, name, GOAL_C, short)
            ratio = http["output_tok_s"] / decode if http else None
            add(f"{name} c={GOAL_C} tok/s / engine decode-only", ">= 0.70", ratio, _at_least(ratio, 0.70))
        http, py = _find(report, name, one, short), _find(report, base, one, short)
        delta = http["ttft_s"]["p50"] - py["ttft_s"]["p50"] if http and py else None
        add(f"{name} - {base} TTFT p50 (s), c={one}", "<= 0.002", delta, _at_most(delta, 0.002))
        http, py = _find(report, name, mid, short), _find(report, base, mid, short)
        ratio = http["ttft_s"]["p50"] / py["ttft_s"]["p50"] if http and py else None
        add(f"{name} / {base} TTFT p50, c={mid}", "<= 1.2", ratio, _at_most(ratio, 1.2))
    errors = sum(c["summary"].get("num_errors", 0) for c in cells if c.get("summary"))
    failed = sum(1 for c in cells if c.get("error"))
    add("requests that failed, or whose usage differed from the tokens received", "0", errors, errors == 0)
    if failed:
        add("cells that did not run", "0", failed, False)
    return out


def _at_least(value: float | None, floor: float) -> bool | None:
    return None if value is None else value >= floor


def _at_most(value: float | None, ceiling: float) -> bool | None:
    return None if value is None else value <= ceiling


def goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issues' goals, as far as this run's cells allow (``met`` None: not decidable here)."""
    return engine_goals(report) + http_goals(report)


def engine_goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 10's goals: the pipelines against the bare engine."""
    grid = report["grid"]
    c = _pick(grid["concurrency"], GOAL_C, max(grid["concurrency"]))
    short = _pick(grid["prompt_lens"], GOAL_LEN, min(grid["prompt_lens"]))
    one = min(grid["concurrency"])
    decode = (report.get("engine_decode_only") or {}).get("decode_tok_s")
    series = [s for s in dict.fromkeys(cell["series"] for cell in report.get("cells", [])) if s != "engine"]
    out: list[dict[str, Any]] = []

    def add(measure: str, goal: str, value: float | None, met: bool | None) -> None:
        out.append({"issue": 10, "measure": measure, "goal": goal, "value": value, "met": met})

    for name in series if GOAL_C in grid["concurrency"] else []:  # the goal is set at c = 64
        cell = _find(report, name, c, short)
        floor = 0.75 if name.endswith("/http") else 0.85 if name.startswith("colocated") else 0.80
        ratio = cell["output_tok_s"] / decode if cell and decode else None
        add(
            f"{name} c={c} prompt {short}: tok/s / engine decode-only tok/s at batch "
            f"{(report.get('engine_decode_only') or {}).get('batch')}",
            f">= {floor}",
            ratio,
            None if ratio is None else ratio >= floor,
        )
    base = _find(report, "engine", one, short)
    for name in series:
        cell = _find(report, name, one, short)
        extra = cell["tpot_s"]["p50"] - base["tpot_s"]["p50"] if cell and base else None
        add(
            f"{name} c={one} prompt {short}: TPOT p50 - engine TPOT p50 (s)",
            "<= 0.0005",
            extra,
            None if extra is None else extra <= 0.0005,
        )
    if LONG_LEN in grid["prompt_lens"]:
        base = _find(report, "engine", one, LONG_LEN)
        for name in series:
            cell = _find(report, name, one, LONG_LEN)
            extra = cell["ttft_s"]["p50"] - base["ttft_s"]["p50"] if cell and base else None
            pd = name.startswith("pd")
            goal = "<= 0.002 + the raw transfer time (not measured here)" if pd else "<= 0.002"
            met = None if extra is None or pd else extra <= 0.002
            add(f"{name} c={one} prompt {LONG_LEN}: TTFT p50 - engine TTFT p50 (s)", goal, extra, met)
    for transport in ("python", "http"):
        coloc = _find(report, f"colocated/{transport}", c, short)
        pd = _find(report, f"pd-read/{transport}", c, short)
        ratio = pd["tpot_s"]["p50"] / coloc["tpot_s"]["p50"] if pd and coloc else None
        add(
            f"pd-read/{transport} TPOT p50 / colocated/{transport} TPOT p50, c={c} prompt {short}",
            "<= 1.2",
            ratio,
            None if ratio is None else ratio <= 1.2,
        )
    return out


def markdown(report: dict[str, Any]) -> str:
    """The README tables: throughput per concurrency, then latency at c=1 and at the goal c."""
    grid = report["grid"]
    concs, lens = grid["concurrency"], grid["prompt_lens"]
    series = list(dict.fromkeys(cell["series"] for cell in report.get("cells", [])))  # in run order
    decode = report.get("engine_decode_only") or {}
    lines = [
        f"Output tokens/s (ratio to the bare engine at the same concurrency), {grid['output_tokens']} output "
        f"tokens per request; bare engine decode-only at batch {decode.get('batch')}: "
        f"{decode.get('decode_tok_s') or 0:,.0f} tok/s.",
        "",
        "| system | prompt | " + " | ".join(f"c={c}" for c in concs) + " |",
        "|---|---|" + "---|" * len(concs),
    ]
    for name in series:
        for length in lens:
            row = []
            for c in concs:
                cell = _find(report, name, c, length)
                base = _find(report, "engine", c, length)
                if cell is None:
                    row.append("-")
                    continue
                ratio = (
                    f" ({cell['output_tok_s'] / base['output_tok_s']:.2f})"
                    if base and name != "engine"
                    else ""
                )
                row.append(f"{cell['output_tok_s']:,.0f}{ratio}")
            lines.append(f"| {name} | {length} | " + " | ".join(row) + " |")
    low, high = min(concs), _pick(concs, GOAL_C, max(concs))
    lines += [
        "",
        f"Latency in ms: TPOT and TTFT p50 / p99 at c={low} and c={high}.",
        "",
        f"| system | prompt | TPOT c={low} | TPOT c={high} | TTFT c={low} | TTFT c={high} |",
        "|---|---|---|---|---|---|",
    ]
    for name in series:
        for length in lens:
            row = []
            for metric in ("tpot_s", "ttft_s"):
                for c in (low, high):
                    cell = _find(report, name, c, length)
                    row.append(f"{_ms(cell[metric]['p50'])} / {_ms(cell[metric]['p99'])}" if cell else "-")
            lines.append(f"| {name} | {length} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def goals_text(rows: list[dict[str, Any]]) -> str:
    """The goals as lines: measure, value, goal, and whether it is met."""
    lines = ["Goals:"]
    for row in rows:
        value = "-" if row["value"] is None else f"{row['value']:.4g}"
        verdict = {True: "met", False: "MISSED", None: "n/a"}[row["met"]]
        lines.append(
            f"  {verdict:>6}  issue {row.get('issue', 10)}: {row['measure']}: {value} (goal {row['goal']})"
        )
    return "\n".join(lines) + "\n"
