"""The control-plane bench's curves: each measure against N, its growth fitted, the goals drawn."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.common import pyplot, save

# (title, unit, how to read the measure from one N's result, the goal at N = 1,000 or None)
MEASURES: list[tuple[str, str, Any, float | None]] = [
    ("coordinator CPU", "cores", lambda r: r.get("coordinator_cpu"), 0.5),
    ("death detected (crash)", "s", lambda r: (r.get("death_crashed") or {}).get("detect_s"), 2.0),
    ("death detected (hang)", "s", lambda r: (r.get("death_hung") or {}).get("detect_s"), None),
    (
        "change reaches all, p99 (worst event)",
        "s",
        lambda r: _worst_p99(r),
        1.0,
    ),
    ("router per request (alone)", "us", lambda r: (r.get("router_alone_us") or {}).get("p50"), 50.0),
    ("router per request (in callers)", "us", lambda r: (r.get("router_us") or {}).get("p50"), 50.0),
    ("ping round trip p50", "ms", lambda r: (r.get("ping_ms") or {}).get("p50"), None),
    ("descriptors, total", "KiB", lambda r: _kib(r.get("descriptor_total_bytes")), None),
    ("coordinator memory (RSS)", "MiB", lambda r: _mib(r.get("coordinator_rss_bytes")), None),
]


def _kib(v: float | None) -> float | None:
    return None if v is None else v / 1024


def _mib(v: float | None) -> float | None:
    return None if v is None else v / 2**20


def _worst_p99(r: dict[str, Any]) -> float | None:
    """The slowest p99 over the death, replacement and scale-up events of one N."""
    spreads = [r.get("scale_up")]
    for how in ("death_crashed", "death_hung"):
        d = r.get(how) or {}
        spreads += [d.get("down"), d.get("replacement")]
    p99s = [s["p99"] for s in spreads if s and s.get("p99") is not None]
    return max(p99s) if p99s else None


def fits(results: list[dict[str, Any]], low: int = 128) -> dict[str, Any]:
    """Each measure's growth over N >= ``low``: the exponent b of y ~ N^b (least squares on
    logs; at most linear is b <= 1) and the linear slope per engine."""
    out: dict[str, Any] = {}
    for title, unit, get, _ in MEASURES:
        pts = [(r["n"], get(r)) for r in results if r["n"] >= low and get(r) is not None and get(r) > 0]
        if len(pts) < 2:
            continue
        xs, ys = [math.log(n) for n, _ in pts], [math.log(y) for _, y in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        exponent = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
        (n0, y0), (n1, y1) = pts[0], pts[-1]
        out[title] = {"exponent": exponent, "per_engine": (y1 - y0) / (n1 - n0), "unit": unit, "points": pts}
    return out


def plot(doc: dict[str, Any], path: Path, baseline: dict[str, Any] | None = None) -> None:
    """A panel per measure against N (log x), this run's points and (when given) a baseline run's."""
    plt = pyplot()
    cols = 3
    rows = math.ceil(len(MEASURES) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows))
    runs = [("this run", doc)] + ([("baseline", baseline)] if baseline else [])
    for ax, (title, unit, get, goal) in zip(axes.flat, MEASURES, strict=False):
        for label, run in runs:
            pts = [(r["n"], get(r)) for r in run["results"] if get(r) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=f"{label} ({run.get('commit', '')[:7]})")
        if goal is not None:
            ax.axhline(goal, color="red", linestyle="--", linewidth=1, label="goal at N = 1,000")
        ax.set_xscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("engines N")
        ax.set_ylabel(unit)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(MEASURES) :]:
        ax.axis("off")
    save(fig, path, "control plane, simulated engines (bench/control_plane.py)")
