"""Tables, goals and plots from the serving benchmark's JSON (bench/serving.py); the goals are data
(bench/goals.json). ``python -m bench.report <result.json>`` writes the .md and .png again."""

from __future__ import annotations

import argparse
import fnmatch
import json
from pathlib import Path
from typing import Any

from bench.common import load_goals, pyplot, save
from bench.report_workloads import n_choices_markdown, prefix_markdown
from bench.tables import div as _div
from bench.tables import ms as _ms
from bench.tables import table as _table


def _x(ratio: float | None) -> str:
    return "" if ratio is None else f"({ratio:.2f}x)"


def _pq(stat: dict[str, Any] | None) -> str:
    return "" if not stat else f"{_ms(stat['p50'])} / {_ms(stat['p99'])}"


def _timings(cell: dict[str, Any]) -> dict[str, Any]:
    return dict((cell.get("summary") or {}).get("timings", {}))


def _metric(summary: dict[str, Any] | None, metric: str) -> float | None:
    if not summary:
        return None
    key, _, q = metric.partition(".")
    value = summary[key]
    return value[q] if q else value


def cell_line(cell: dict[str, Any]) -> str:
    head = f"[{cell['series']}] prompt {cell.get('prompt_len')} {cell.get('load')}:"
    s = cell.get("summary")
    if s is None:
        return f"{head} ERROR {cell.get('error')}"
    parts = [
        f"{s['num_ok']}/{s['num_requests']} ok",
        f"{s['output_tok_s']:,.0f} tok/s",
        f"TPOT p50 {_ms(s['tpot_s']['p50'])} p99 {_ms(s['tpot_s']['p99'])} ms",
        f"TTFT p50 {_ms(s['ttft_s']['p50'])} p99 {_ms(s['ttft_s']['p99'])} ms",
    ]
    if "handoff_s" in s.get("timings", {}):
        parts.append(f"handoff p50 {_ms(s['timings']['handoff_s']['p50'])} ms")
    if "client" in cell:
        use = cell["client"]["max_utilization"]
        parts.append(f"{s['tokens_per_chunk'] or 0:.1f} tokens/event, client CPU {use:.0%}")
    elif cell.get("wall_s"):
        parts.append(f"driver CPU {cell['caller_cpu_s'] / cell['wall_s']:.0%}")
    per_1k = cpu_per_1k(cell)
    if per_1k:
        parts.append(f"CPU {sum(per_1k.values()):,.0f} ms per 1k tokens")
    parts.append(f"{cell.get('wall_s', 0.0):.1f} s")
    return f"{head} " + ", ".join(parts + [f"errors: {e}" for e in s["errors"][:1]])


def cpu_per_1k(cell: dict[str, Any]) -> dict[str, float]:
    """CPU milliseconds per 1,000 output tokens of each part (the Ray daemons' own left out)."""
    tokens = (cell.get("summary") or {}).get("output_tokens") or 0
    spent = cell.get("cpu_s") or {}
    return {part: s / tokens * 1e6 for part, s in spent.items() if part != "ray"} if tokens else {}


PARTS = ("caller", "ingress", "haproxy", "worker:colocated", "worker:prefill", "worker:decode", "client")


def cpu_table(report: dict[str, Any]) -> list[str]:
    """CPU ms per 1,000 output tokens by process, one row per cell that measured it."""
    rows = []
    for cell in report.get("cells", []):
        per_1k = cpu_per_1k(cell)
        if not per_1k:
            continue
        shown = [f"{per_1k[p]:,.0f}" if p in per_1k else "" for p in PARTS]
        rest = sum(v for p, v in per_1k.items() if p not in PARTS)
        rows.append([cell["series"], str(cell["prompt_len"]), cell["load"], *shown, f"{rest:,.0f}"])
        rows[-1].append(f"{sum(per_1k.values()):,.0f}")
    if not rows:
        return []
    head = ["series", "prompt", "load", *PARTS, "other", "all"]
    title = "CPU ms per 1,000 output tokens, by process (Ray's own daemons left out)."
    return ["", title, "", *_table(head, rows)]


def find(report: dict[str, Any], series: str, load: str, prompt: int) -> dict[str, Any] | None:
    """The summary of a cell that has a request done, or None."""
    for cell in report.get("cells", []):
        if (cell["series"], cell.get("load"), cell.get("prompt_len")) == (series, load, prompt):
            s = cell.get("summary")
            return s if s and s["num_ok"] else None
    return None


def loads(report: dict[str, Any]) -> list[str]:
    grid = report["grid"]
    return [f"c={c}" for c in grid["concurrency"]] + [f"rate={r:g}" for r in grid.get("rates", [])]


def series_of(report: dict[str, Any]) -> list[str]:
    return list(dict.fromkeys(c["series"] for c in report.get("cells", [])))  # in run order


# -- goals -----------------------------------------------------------------------------------------


def goals(report: dict[str, Any], rules: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Each goal of bench/goals.json for each series it names, as far as the run's cells allow
    (``met`` None: not decidable here; a goal whose load or prompt the grid lacks is left out)."""
    out: list[dict[str, Any]] = []
    first, cells = next(iter(loads(report)), None), report.get("cells", [])
    decode = (report.get("engine_decode_only") or {}).get("decode_tok_s")

    def add(g: dict[str, Any], measure: str, value: Any, met: bool | None, goal: str = "") -> None:
        goal = goal or f"{'>=' if 'at_least' in g else '<='} {g.get('at_least', g.get('at_most'))}"
        out.append(
            {
                "issue": g["issue"],
                "measure": measure,
                "goal": goal + (f" ({g['note']})" if "note" in g else ""),
                "value": value,
                "met": met,
            }
        )

    for g in rules if rules is not None else load_goals("serving"):
        if g["metric"] == "errors":
            errors = sum(c["summary"].get("num_errors", 0) for c in cells if c.get("summary"))
            add(
                g,
                "requests that failed, or whose usage differed from the tokens received",
                errors,
                errors <= g["at_most"],
            )
            if failed := sum(1 for c in cells if c.get("error")):
                add(g, "cells that did not run", failed, False, "0")
            continue
        load = first if g["load"] == "first" else g["load"]
        if load not in loads(report) or g["prompt"] not in report["grid"]["prompt_lens"]:
            continue
        for name in (n for n in series_of(report) if n != "engine" and fnmatch.fnmatch(n, g["series"])):
            system, _, transport = name.partition("/")
            base_name = g["base"].format(system=system, transport=transport)
            value = _metric(find(report, name, load, g["prompt"]), g["metric"])
            base = (
                decode
                if base_name == "decode_only"
                else _metric(find(report, base_name, load, g["prompt"]), g["metric"])
            )
            if g["compare"] == "ratio":
                result = _div(value, base)
            else:
                result = None if value is None or base is None else value - base
            met = (
                None
                if result is None or g.get("decided") is False
                else (result >= g["at_least"] if "at_least" in g else result <= g["at_most"])
            )
            what = "/" if g["compare"] == "ratio" else "-"
            add(g, f"{name} {g['metric']} {what} {base_name}, {load} prompt {g['prompt']}", result, met)
    return out


def goals_text(rows: list[dict[str, Any]]) -> str:
    lines = ["Goals (bench/goals.json):"]
    for row in rows:
        value = "-" if row["value"] is None else f"{row['value']:.4g}"
        verdict = {True: "met", False: "MISSED", None: "n/a"}[row["met"]]
        lines.append(f"  {verdict:>6}  issue {row['issue']}: {row['measure']}: {value} (goal {row['goal']})")
    return "\n".join(lines) + "\n"


# -- tables ----------------------------------------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
    """Throughput per load (ratio to the bare engine), latency at the first and the c=64 (or last)
    load, each transport against the Python API, and the handoff breakdown where measured."""
    names, lens, columns = series_of(report), report["grid"]["prompt_lens"], loads(report)
    decode = report.get("engine_decode_only") or {}
    head = (
        f"Output tokens/s (ratio to the bare engine at the same load), {report['grid']['output_tokens']} "
        "output tokens per request"
    )
    if decode:
        rate = decode.get("decode_tok_s") or 0
        head += f"; bare engine decode-only at batch {decode.get('batch')}: {rate:,.0f} tok/s"
    lines = [head + ".", ""]
    rows = []
    for name in names:
        for n in lens:
            row = [name, str(n)]
            for load in columns:
                cell, base = find(report, name, load, n), find(report, "engine", load, n)
                ratio = (
                    _div(cell["output_tok_s"], base["output_tok_s"])
                    if cell and base and name != "engine"
                    else None
                )
                shown = "" if ratio is None else f" ({ratio:.2f})"
                row.append("-" if cell is None else f"{cell['output_tok_s']:,.0f}{shown}")
            rows.append(row)
    lines += _table(["system", "prompt", *columns], rows)
    if not columns:
        return "\n".join(lines) + "\n"
    picked = list(dict.fromkeys([columns[0], "c=64" if "c=64" in columns else columns[-1]]))
    rows = []
    for name in names:
        for n in lens:
            cells = [
                (metric, find(report, name, load, n)) for metric in ("tpot_s", "ttft_s") for load in picked
            ]
            rows.append([name, str(n), *(_pq(s[metric]) if s else "-" for metric, s in cells)])
    lines += ["", f"Latency in ms: TPOT and TTFT p50 / p99 at {' and '.join(picked)}.", ""]
    lines += _table(["system", "prompt", *(f"{m} {load}" for m in ("TPOT", "TTFT") for load in picked)], rows)
    rows = []
    for name in (x for x in names if "/" in x and not x.endswith("/python")):
        base_name = name.split("/")[0] + "/python"
        for n in lens:
            for load in columns:
                s, b = find(report, name, load, n), find(report, base_name, load, n)
                if s:
                    ttft, base_ttft = s["ttft_s"]["p50"], b["ttft_s"]["p50"] if b else None
                    diff = "" if base_ttft is None else f"{(ttft - base_ttft) * 1e3:+.1f}"
                    tok = _x(_div(s["output_tok_s"], b["output_tok_s"] if b else None))
                    rows.append([name, str(n), load, f"{s['output_tok_s']:,.0f}", tok, _ms(ttft), diff])
                    rows[-1].append(_x(_div(ttft, base_ttft)))
    if rows:
        lines += ["", "Against the same system's Python API (tok/s, TTFT p50 in ms).", ""]
        lines += _table(
            ["series", "prompt", "load", "tok/s", "/ python", "TTFT p50", "- python", "/ python"], rows
        )
    rows, cells = [], report.get("cells", [])
    for cell in cells if any("handoff_s" in _timings(c) for c in cells) else []:
        t = _timings(cell)
        if "handoff_s" in t or (cell.get("summary") and cell["series"] == "colocated/python"):
            raw = t.get("transfer_s") or t.get("push_wait_s")
            row = [cell["series"], cell["load"], str(cell["prompt_len"]), _pq(t.get("handoff_s"))]
            row += [_ms(t[k]["p50"]) if k in t else "" for k in ("handoff_rpc_s", "handoff_local_s")]
            row += ["" if raw is None else _ms(raw["p50"]) + " (push wait)" * ("push_wait_s" in t)]
            rows.append([*row, _pq(cell["summary"]["ttft_s"])])
    if rows:
        lines += ["", "Handoff (prefill done -> D decoding, less the raw transfer), p50 / p99 in ms.", ""]
        lines += _table(
            ["series", "load", "prompt", "handoff", "P -> D", "on D", "raw transfer", "TTFT"], rows
        )
    lines += cpu_table(report)
    return "\n".join(lines) + "\n"


# -- plots -----------------------------------------------------------------------------------------


def plot(report: dict[str, Any], path: Path) -> None:
    """Per prompt length: output tok/s, TPOT p50 and TTFT p50 per load, one line per series."""
    plt, lens, columns = pyplot(), report["grid"]["prompt_lens"], loads(report)
    panels = (
        ("output tokens/s", "output_tok_s"),
        ("TPOT p50 (ms)", "tpot_s.p50"),
        ("TTFT p50 (ms)", "ttft_s.p50"),
    )
    fig, axes = plt.subplots(len(lens), 3, figsize=(18, 4 * len(lens)), squeeze=False)
    for row, n in enumerate(lens):
        for ax, (title, metric) in zip(axes[row], panels, strict=True):
            for name in series_of(report):
                ys = [_metric(find(report, name, load, n), metric) for load in columns]
                ys = [float("nan") if y is None else y * (1 if metric == "output_tok_s" else 1e3) for y in ys]
                style = {"color": "black", "linestyle": "--"} if name == "engine" else {}
                ax.plot(range(len(columns)), ys, marker="o", label=name, **style)
            ax.set(title=f"{title}, prompt {n}", yscale="log")
            ax.set_xticks(range(len(columns)), columns)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    host = report["host"].get("gpu") or report["host"]["cpu"]
    save(
        fig,
        path,
        f"serving: {report['args']['config']} on {host}, {report['grid']['output_tokens']} output tokens "
        f"({report['commit']})",
    )


def bars(path: Path, title: str, labels: list[str], panels: list[tuple[str, dict[str, list[float]]]]) -> None:
    """One bar panel per (title, {series: a value per label})."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (name, groups) in zip(axes[0], panels, strict=True):
        width = 0.8 / len(groups)
        for k, (group, ys) in enumerate(groups.items()):
            ax.bar([i + width * k for i in range(len(labels))], ys, width=width, label=group)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, fontsize=8)
        ax.set_title(name)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    save(fig, path, title)


def render(report: dict[str, Any], stem: Path) -> None:
    """Write ``stem``.md and .png from a result, and print the tables (and the goals)."""
    cells, text, png = report["cells"], "", stem.with_suffix(".png")
    try:
        if report["workload"] == "random":
            text = markdown(report)
            report_goals = goals(report)
            plot(report, png)
            text += "\n" + goals_text(report_goals)
            for series, procs in report.get("profiles", {}).items():
                text += f"\nProfile of {series} (py-spy, GIL samples):\n"
                for proc, prof in procs.items():
                    top = ", ".join(f"{f} {n}" for _, f, n in prof.get("top", [])[:6])
                    text += f"- {proc}: {prof.get('samples', prof.get('error'))} samples; {top}\n"
        elif report["workload"] == "shared-prefix":
            text = prefix_markdown(report)
            groups = list(dict.fromkeys((c["series"], c["reuse"]) for c in cells))
            labels = [f"{s} {r:.0%}" for s, r in groups]

            def values(key: str, on: bool, scale: float = 1.0) -> list[float]:
                pick = {(c["series"], c["reuse"]): c for c in cells if c["cache"] == on}
                return [_metric(pick[g], key) * scale for g in groups]  # type: ignore[operator]

            panels = [
                (t, {f"cache {'on' if on else 'off'}": values(k, on, s) for on in (False, True)})
                for t, k, s in (
                    ("TTFT p50 (ms)", "ttft_s.p50", 1e3),
                    ("output tokens/s", "output_tok_s", 1.0),
                    ("KiB moved per request", "transfer_bytes.mean", 1 / 1024),
                    ("hit rate on P", "hit_rate_prefill", 1.0),
                )
            ]
            bars(png, f"shared-prefix workload ({report['commit']})", labels, panels)
        else:
            text = n_choices_markdown(report)
    except Exception as exc:  # the JSON is what matters; say why a table or the picture is missing
        text += f"\n(no complete tables or plot: {type(exc).__name__}: {exc})\n"
    stem.with_suffix(".md").write_text(text)
    print("\n" + text, flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("result", type=Path, help="a JSON written by bench/serving.py")
    return p


def main() -> None:
    path = parser().parse_args().result
    render(json.loads(path.read_text()), path.with_suffix(""))


if __name__ == "__main__":
    main()
