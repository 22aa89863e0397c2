"""Summary (goals, ratios) and plot of ``transfer_gpu_bench.py``'s result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

GB = 1e9
GOAL_FRACTION = 0.95  # of the contiguous peer copy, layer-major, prompts >= 1k tokens
GOAL_LATENCY_S = 100e-6  # 128-token prompt


def _by_name(rows: Any) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in rows} if isinstance(rows, list) else {}


def summarize(result: dict[str, Any]) -> None:
    """Adds ``result["summary"]``: one row per case with GB/s, ratios and the goals' verdicts."""
    ceil = result["ceiling"]["gbps"]
    nixl, nccl = _by_name(result.get("nixl")), _by_name(result.get("nccl"))
    table, goals = [], []
    for r in result["cases"]:
        row = {
            "case": r["case"],
            "segments": r["segments"],
            "MiB": round(r["bytes"] / 2**20, 1),
            "read_GBps": round(r["read_gbps"], 1),
            "write_GBps": round(r["write_gbps"], 1),
            "read_us": round(r["read_device_s"] * 1e6, 1),
            "write_us": round(r["write_device_s"] * 1e6, 1),
            "read_host_us": round(r["read_host_s"] * 1e6, 1),
            "write_host_us": round(r["write_host_s"] * 1e6, 1),
            "read_vs_ceiling": round(r["read_vs_ceiling"], 3),
            "write_vs_ceiling": round(r["write_vs_ceiling"], 3),
            "verified": all(r.get(k, True) for k in ("read_verified", "write_verified", "naive_verified")),
        }
        if "naive_gbps" in r:
            row["naive_GBps"] = round(r["naive_gbps"], 2)
            row["write_vs_naive"] = round(r["naive_s"] / r["write_host_s"], 1)
        # baselines are timed on the host: compare them with our host latency (issue -> wait returned)
        for label, base in (("nixl", nixl), ("nccl", nccl)):
            b = base.get(r["case"])
            if b:
                row[f"{label}_GBps"] = round(r["bytes"] / b["host_s"] / GB, 1)
                row[f"{label}_us"] = round(b["host_s"] * 1e6, 1)
                row[f"write_vs_{label}"] = round(b["host_s"] / r["write_host_s"], 2)
        table.append(row)
        if r["order"] == "layer_major" and r["tokens"] >= 1024:
            for op in ("read", "write"):
                goals.append(
                    {
                        "goal": f">= {GOAL_FRACTION:.0%} of ceiling",
                        "case": r["case"],
                        "op": op,
                        "value": round(r[f"{op}_vs_ceiling"], 3),
                        "met": r[f"{op}_vs_ceiling"] >= GOAL_FRACTION,
                    }
                )
        if r["tokens"] == 128 and r["order"] == "layer_major":
            for op in ("read", "write"):
                for kind in ("device", "host"):
                    v = r[f"{op}_{kind}_s"]
                    goals.append(
                        {
                            "goal": "<= 100 us",
                            "case": r["case"],
                            "op": f"{op} ({kind})",
                            "value_us": round(v * 1e6, 1),
                            "met": v <= GOAL_LATENCY_S,
                        }
                    )
    result["summary"] = {"ceiling_GBps": round(ceil, 1), "table": table, "goals": goals}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ceil = result["ceiling"]["gbps"]
    nixl, nccl = _by_name(result.get("nixl")), _by_name(result.get("nccl"))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, order in zip(axes, ("layer_major", "block_major"), strict=True):
        rows = [r for r in result["cases"] if r["order"] == order]
        x = [r["tokens"] for r in rows]
        series = {
            "cuda_ipc read (device)": [r["read_gbps"] for r in rows],
            "cuda_ipc write (device)": [r["write_gbps"] for r in rows],
            "cuda_ipc write (host)": [r["bytes"] / r["write_host_s"] / GB for r in rows],
            "naive copy_ per segment": [r.get("naive_gbps") for r in rows],
            "NIXL write (host)": [
                r["bytes"] / nixl[r["case"]]["host_s"] / GB if r["case"] in nixl else None for r in rows
            ],
            "NCCL send/recv (host)": [
                r["bytes"] / nccl[r["case"]]["host_s"] / GB if r["case"] in nccl else None for r in rows
            ],
        }
        for label, ys in series.items():
            pts = [(a, b) for a, b in zip(x, ys, strict=True) if b is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=label)
        ax.axhline(ceil, ls="--", c="k", label=f"contiguous peer copy {ceil:.0f} GB/s")
        ax.axhline(ceil * 0.95, ls=":", c="grey", label="95 % of it")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_title(f"{order.replace('_', '-')} cache, GPU 0 -> GPU 1")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"KV transfer, Llama-3.1-8B-like cache, {result['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
