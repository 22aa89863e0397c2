"""Summary, printed table, goals and plot of ``transfer_gpu_bench.py``'s result (no GPU needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

GOALS = {
    "small_e2e_us": 40.0,  # 128-token prompt (512 x 32 KiB), end to end
    "layer_major_vs_ceiling": 0.85,  # >= 1k tokens
    "contiguous_vs_ceiling": 0.95,
    "vs_peers": 20.0,
    "decode_slowdown": 0.10,  # while a 4k-token transfer runs
}
OURS = ("auto", "kernel", "copy_engine")  # the rows compared with the peers and the goals


def _gbps(nbytes: int, us: float | None) -> float | None:
    return round(nbytes / us / 1e3, 1) if us else None


def summarize(result: dict[str, Any]) -> None:
    """Adds ``result["summary"]``: per case and op, GB/s and ratios; the goals with their verdicts."""
    rows = result.get("table") or []
    by = {(r["case"], r["op"], r["variant"]): r for r in rows}
    table, goals = [], []
    for (case, op, variant), r in by.items():
        ceil = by.get((case, op, "ceiling"))
        row = {
            "case": case,
            "op": op,
            "variant": variant,
            "method": r.get("method"),
            "segments": r["segments"],
            "MiB": round(r["bytes"] / 2**20, 1),
            "host_us": r["host_us"],
            "device_us": r["device_us"],
            "host_GBps": _gbps(r["bytes"], r["host_us"]),
            "device_GBps": _gbps(r["bytes"], r["device_us"]),
            "verified": r.get("verified"),
        }
        if ceil and ceil.get("device_us") and r.get("device_us"):
            row["device_vs_ceiling"] = round(ceil["device_us"] / r["device_us"], 3)
        if ceil and ceil.get("host_us") and r.get("host_us"):
            row["host_vs_ceiling"] = round(ceil["host_us"] / r["host_us"], 3)
        for p in result.get("peers") or []:
            if p["case"] == case and p["op"] == op and p.get("host_us") and r.get("host_us"):
                row[f"x_vs_{p['peer']}_{p['mode']}"] = round(p["host_us"] / r["host_us"], 1)
        table.append(row)
    for row in table:
        if row["variant"] not in OURS:
            continue
        if row["case"] == "layer_major/128":
            goals.append(
                _goal(
                    "<= 40 us end to end",
                    row,
                    row["host_us"],
                    row["host_us"] is not None and row["host_us"] <= GOALS["small_e2e_us"],
                )
            )
        if (
            row["case"].startswith("layer_major/")
            and int(row["case"].split("/")[1]) >= 1024
            and "device_vs_ceiling" in row
        ):
            v = row["device_vs_ceiling"]
            goals.append(
                _goal(">= 85 % of the contiguous copy (device)", row, v, v >= GOALS["layer_major_vs_ceiling"])
            )
        if row["case"] == "contiguous/2GiB" and "device_vs_ceiling" in row:
            v = row["device_vs_ceiling"]
            goals.append(
                _goal(">= 95 % of cudaMemcpyAsync (device)", row, v, v >= GOALS["contiguous_vs_ceiling"])
            )
        if row["case"].startswith("layer_major/"):
            for k, v in row.items():
                if k.startswith("x_vs_"):
                    goals.append(_goal(f">= 20x {k[5:]} (host)", row, v, v >= GOALS["vs_peers"]))
    load = result.get("load") or {}
    for r in load.get("rows", []):
        if "decode_slowdown" in r:
            ok = r["decode_slowdown"] <= GOALS["decode_slowdown"]
            goals.append(
                {
                    "goal": "decode slowdown <= 10 % (4k transfer)",
                    "variant": r["variant"],
                    "value": r["decode_slowdown"],
                    "met": ok,
                }
            )
    result["summary"] = {"table": table, "goals": goals, "recommendation": recommend(table, load)}


def _goal(goal: str, row: dict[str, Any], value: Any, met: bool) -> dict[str, Any]:
    return {
        "goal": goal,
        "case": row["case"],
        "op": row["op"],
        "variant": row["variant"],
        "value": value,
        "met": met,
    }


def recommend(table: list[dict[str, Any]], load: dict[str, Any]) -> dict[str, Any]:
    """The fastest of our methods per case (host time), and the least decode slowdown under load."""
    fastest: dict[str, str] = {}
    for row in table:
        if row["variant"] in ("ceiling", "naive") or row["host_us"] is None:
            continue
        key = f"{row['case']}/{row['op']}"
        best = next(
            (r for r in table if f"{r['case']}/{r['op']}" == key and r["variant"] == fastest.get(key)), None
        )
        if best is None or row["host_us"] < best["host_us"]:
            fastest[key] = row["variant"]
    loaded = [r for r in load.get("rows", []) if "decode_slowdown" in r]
    least = min(loaded, key=lambda r: r["decode_slowdown"])["variant"] if loaded else None
    return {"fastest_idle_by_host_time": fastest, "least_decode_slowdown": least}


def print_table(result: dict[str, Any]) -> None:
    """One line per case and op: host/device µs of every variant, the ceiling ratio and the peers."""
    s = result.get("summary") or {}
    print(f"\n== {result.get('gpu')} | commit {result.get('commit')} | kernel {result.get('kernel_variant')}")
    print("host us / device us per variant; 'ceil' = kernel device vs ceiling; peers: host-time ratios")
    lines: dict[tuple[str, str], list[str]] = {}
    extra: dict[tuple[str, str], str] = {}
    for r in s.get("table", []):
        key = (r["case"], r["op"])
        lines.setdefault(key, []).append(f"{r['variant']}={r['host_us']}/{r['device_us']}")
        if r["variant"] == "auto":
            peers = " ".join(f"{k[5:]}={v}x" for k, v in r.items() if k.startswith("x_vs_"))
            extra[key] = f"auto ceil={r.get('device_vs_ceiling')} {peers}"
    for key, cells in lines.items():
        print(f"{key[0]:>17} {key[1]:5} {' '.join(cells)} | {extra.get(key, '')}")
    for p in result.get("peers") or []:
        rate = _gbps(p["bytes"], p["host_us"])
        print(
            f"{p['peer']:>9} {p['mode']:7} {p['case']:>18} {p['op']:5} host {p['host_us']} us = {rate} GB/s"
        )
    b = result.get("breakdown")
    if b:
        print("breakdown (us):", {k: v for k, v in b.items() if k.endswith("_us")})
    for r in (result.get("load") or {}).get("rows", []):
        print("load:", r)
    for g in s.get("goals", []):
        where = f"{g.get('case', '')} {g.get('op', '')} {g['variant']}"
        print(f"goal {'MET ' if g['met'] else 'MISS'} {g['goal']:<42} {where}: {g['value']}")
    print("recommendation:", s.get("recommendation"))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = (result.get("summary") or {}).get("table", [])
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for ax, op in zip(axes, ("read", "write"), strict=True):
        series: dict[str, list[float | None]] = {}
        for r in rows:
            if r["op"] == op:
                series.setdefault(f"{r['variant']} (host)", [None] * len(cases))[cases.index(r["case"])] = r[
                    "host_GBps"
                ]
                if r["variant"] in ("ceiling", "kernel") and r["device_GBps"]:
                    series.setdefault(f"{r['variant']} (device)", [None] * len(cases))[
                        cases.index(r["case"])
                    ] = r["device_GBps"]
        for p in result.get("peers") or []:
            if p["op"] == op and p["case"] in cases:
                series.setdefault(f"{p['peer']} {p['mode']} (host)", [None] * len(cases))[
                    cases.index(p["case"])
                ] = _gbps(p["bytes"], p["host_us"])
        for label, ys in series.items():
            pts = [(i, y) for i, y in enumerate(ys) if y]
            if pts:
                ax.plot(
                    [i for i, _ in pts],
                    [y for _, y in pts],
                    marker="o",
                    label=label,
                    ls="--" if "ceiling" in label else "-",
                )
        ax.set_xticks(range(len(cases)), [c.split("/")[1] for c in cases])
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens (layer-major, 32 KiB segments) / contiguous")
        ax.set_title(f"{op} ({'D pulls' if op == 'read' else 'P pushes'})")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"KV transfer between two processes, {result.get('gpu')} ({result['args']['gpus']} GPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
