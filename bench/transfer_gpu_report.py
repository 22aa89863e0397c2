"""The GPU transfer bench's result: the summary against the ceilings and peers, its table and plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.common import load_goals, pyplot, save

OURS = ("auto", "kernel", "copy_engine")  # the rows compared with the peers and the goals


def _ratio(a: float | None, b: float | None, digits: int) -> float | None:
    return round(a / b, digits) if a and b else None


def _gbps(nbytes: int, us: float | None) -> float | None:
    return round(nbytes / us / 1e3, 1) if us else None


def summarize(result: dict[str, Any]) -> None:
    """``result["summary"]``: per case, op and variant GB/s and ratios to the ceiling and the peers;
    the goals (bench/goals.json) with their verdicts; the fastest of our methods per case."""
    goal, by = (
        load_goals("transfer_gpu"),
        {(r["case"], r["op"], r["variant"]): r for r in result.get("table") or []},
    )
    table, goals, fastest = [], [], dict[str, str]()
    for (name, op, variant), r in by.items():
        ceil = by.get((name, op, "ceiling")) or {}
        row = {
            k: r.get(k)
            for k in ("case", "op", "variant", "method", "segments", "host_us", "device_us", "verified")
        }
        for k in ("host", "device"):
            row[f"{k}_GBps"] = _gbps(r["bytes"], r[f"{k}_us"])
            row[f"{k}_vs_ceiling"] = _ratio(ceil.get(f"{k}_us"), r.get(f"{k}_us"), 3)
        for p in (p for p in result.get("peers") or [] if (p["case"], p["op"]) == (name, op)):
            row[f"x_vs_{p['peer']}_{p['mode']}"] = _ratio(p.get("host_us"), r.get("host_us"), 1)
        table.append(row)
        if variant not in OURS:
            continue
        best = by.get((name, op, fastest.get(f"{name}/{op}", "")))
        if r["host_us"] is not None and (best is None or r["host_us"] < best["host_us"]):
            fastest[f"{name}/{op}"] = variant
        tokens, v = (
            int(name.split("/")[1]) if name.startswith("layer_major/") else 0,
            row["device_vs_ceiling"],
        )
        checks = [
            (
                tokens == 128,
                f"<= {goal['small_e2e_us']} us end to end",
                row["host_us"],
                goal["small_e2e_us"],
                -1,
            ),
            (
                tokens >= 1024,
                f">= {goal['layer_major_vs_ceiling']} of the contiguous copy (device)",
                v,
                goal["layer_major_vs_ceiling"],
                1,
            ),
            (
                name == "contiguous/2GiB",
                f">= {goal['contiguous_vs_ceiling']} of cudaMemcpyAsync (device)",
                v,
                goal["contiguous_vs_ceiling"],
                1,
            ),
        ]
        checks += [
            (tokens > 0, f">= {goal['vs_peers']}x {k[5:]} (host)", x, goal["vs_peers"], 1)
            for k, x in row.items()
            if k.startswith("x_vs_")
        ]
        for applies, what, value, bound, sign in checks:
            if applies and value is not None:
                met = value >= bound if sign > 0 else value <= bound
                goals.append(
                    {"goal": what, "case": name, "op": op, "variant": variant, "value": value, "met": met}
                )
    loaded = [r for r in (result.get("load") or {}).get("rows", []) if "decode_slowdown" in r]
    for r in loaded:
        met = r["decode_slowdown"] <= goal["decode_slowdown"]
        what = f"decode slowdown <= {goal['decode_slowdown']} (4k transfer)"
        goals.append({"goal": what, "variant": r["variant"], "value": r["decode_slowdown"], "met": met})
    least = min(loaded, key=lambda r: r["decode_slowdown"])["variant"] if loaded else None
    recommend = {"fastest_idle_by_host_time": fastest, "least_decode_slowdown": least}
    result["summary"] = {"table": table, "goals": goals, "recommendation": recommend}


def print_table(result: dict[str, Any]) -> None:
    s = result.get("summary") or {}
    print(f"\n== {result.get('gpu')} | commit {result.get('commit')} | kernel {result.get('kernel_variant')}")
    for r in s.get("table", []):
        ratios = {k: v for k, v in r.items() if k.startswith("x_vs_") or k.endswith("_vs_ceiling")}
        times = f"host {r['host_us']} us, device {r['device_us']} us"
        print(f"{r['case']:>17} {r['op']:5} {r['variant']:>20}: {times} {ratios}")
    for p in result.get("peers") or []:
        print(f"{p['peer']:>9} {p['mode']:7} {p['case']:>18} {p['op']:5} host {p['host_us']} us")
    for key in ("breakdown", "load"):
        print(f"{key}:", json.dumps(result.get(key), default=str)[:3000])
    for g in s.get("goals", []):
        where = f"{g.get('case', '')} {g.get('op', '')} {g['variant']}"
        print(f"goal {'MET ' if g['met'] else 'MISS'} {g['goal']}: {where}: {g['value']}")
    print("recommendation:", s.get("recommendation"))


def plot(result: dict[str, Any], path: Path) -> None:
    rows = (result.get("summary") or {}).get("table", [])
    names = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = pyplot().subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for ax, op in zip(axes, ("read", "write"), strict=True):
        series: dict[str, dict[str, float | None]] = {}
        for r in (r for r in rows if r["op"] == op):
            series.setdefault(f"{r['variant']} (host)", {})[r["case"]] = r["host_GBps"]
            if r["variant"] in ("ceiling", "kernel"):
                series.setdefault(f"{r['variant']} (device)", {})[r["case"]] = r["device_GBps"]
        for p in (p for p in result.get("peers") or [] if p["op"] == op):
            series.setdefault(f"{p['peer']} {p['mode']} (host)", {})[p["case"]] = _gbps(
                p["bytes"], p["host_us"]
            )
        for label, ys in series.items():
            pts = [(names.index(c), y) for c, y in ys.items() if y and c in names]
            ax.plot(
                [i for i, _ in pts],
                [y for _, y in pts],
                marker="o",
                label=label,
                ls="--" if "ceiling" in label else "-",
            )
        ax.set_xticks(range(len(names)), [c.split("/")[1] for c in names])
        ax.set(yscale="log", xlabel="prompt tokens (layer-major, 32 KiB segments) / contiguous", title=op)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=7, loc="lower right")
    save(fig, path, f"KV transfer between two processes, {result.get('gpu')} ({result['args']['gpus']} GPU)")
