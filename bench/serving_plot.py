"""The serving benchmark's PNG: per prompt length, output tok/s, TPOT p50 and TTFT p50 against
concurrency, one line per system and transport, the bare engine drawn dashed in black."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PANELS = (
    ("output tokens/s", "output_tok_s", None, 1.0),
    ("TPOT p50 (ms)", "tpot_s", "p50", 1e3),
    ("TTFT p50 (ms)", "ttft_s", "p50", 1e3),
)


def _value(cell: dict[str, Any], key: str, q: str | None, scale: float) -> float:
    summary = cell.get("summary")
    if not summary or not summary.get("num_ok"):
        return float("nan")
    value = summary[key] if q is None else summary[key][q]
    return float("nan") if value is None else float(value) * scale


def plot(report: dict[str, Any], path: Path) -> None:
    """Draw ``report["cells"]`` (see serving_bench.py) into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, NullLocator

    grid = report["grid"]
    lens, concs = grid["prompt_lens"], grid["concurrency"]
    series = list(dict.fromkeys(c["series"] for c in report["cells"]))  # in run order: the engine first
    fig, axes = plt.subplots(len(lens), len(PANELS), figsize=(6 * len(PANELS), 4 * len(lens)), squeeze=False)
    for row, prompt_len in enumerate(lens):
        for col, (title, key, q, scale) in enumerate(PANELS):
            ax = axes[row][col]
            for name in series:
                by_c = {
                    c["concurrency"]: c
                    for c in report["cells"]
                    if c["series"] == name and c["prompt_len"] == prompt_len
                }
                ys = [_value(by_c[c], key, q, scale) if c in by_c else float("nan") for c in concs]
                style = {"color": "black", "linestyle": "--"} if name == "engine" else {}
                ax.plot(concs, ys, marker="o", label=name, **style)
            ax.set(title=f"{title}, prompt {prompt_len}", xlabel="concurrency", xscale="log", yscale="log")
            ax.xaxis.set_minor_locator(NullLocator())
            ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
            ax.set_xticks(concs, [str(c) for c in concs])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    env = report["environment"]
    fig.suptitle(
        f"serving_bench: {report['model']} on {env['device']}, {grid['output_tokens']} output tokens, "
        f"closed loop ({report['commit']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
