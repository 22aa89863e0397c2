"""Report tables of the serving benchmark's other workloads: shared-prefix (the prefix cache off
and on) and n-choices (one request of n choices against n requests)."""

from __future__ import annotations

from typing import Any

from bench.tables import div as _div
from bench.tables import ms as _ms
from bench.tables import table as _table


def prefix_line(c: dict[str, Any]) -> str:
    kib = [(c["transfer_bytes"][q] or 0) / 1024 for q in ("mean", "p50")]
    return (
        f"[{c['series']} cache={'on' if c['cache'] else 'off'} reuse={c['reuse']:.0%}] TTFT p50 "
        f"{_ms(c['ttft_s']['p50'])} ms, {c['output_tok_s']:.0f} tok/s, {kib[0]:.0f} KiB/request (p50 "
        f"{kib[1]:.0f}), hit rate P {c['hit_rate_prefill']:.0%} D {c['hit_rate_decode']:.0%}"
    )


def prefix_markdown(report: dict[str, Any]) -> str:
    cells, rows, ratios = report["cells"], [], []
    for c in cells:
        kib = (
            f"{(c['transfer_bytes']['mean'] or 0) / 1024:.0f}, {(c['transfer_bytes']['p50'] or 0) / 1024:.0f}"
        )
        rows.append(
            [
                c["series"],
                f"{c['reuse']:.0%}",
                "on" if c["cache"] else "off",
                _ms(c["ttft_s"]["p50"]),
                _ms(c["ttft_s"]["p99"]),
                f"{c['output_tok_s']:.0f}",
                kib,
                f"{c['cached_tokens_per_request'] or 0:.0f}",
                f"{c['hit_rate_prefill']:.0%} / {c['hit_rate_decode']:.0%}",
            ]
        )
    for on in (c for c in cells if c["cache"]):
        off = next(
            c for c in cells if (c["series"], c["reuse"], c["cache"]) == (on["series"], on["reuse"], False)
        )
        moved = [_div(on["transfer_bytes"][q], off["transfer_bytes"][q]) for q in ("mean", "p50")]
        ratios.append(
            [
                on["series"],
                f"{on['reuse']:.0%}",
                f"{_div(off['ttft_s']['p50'], on['ttft_s']['p50']) or 0:.2f}x",
                f"{_div(on['output_tok_s'], off['output_tok_s']) or 0:.3f}",
                ", ".join(f"{m or 0:.3f}" for m in moved),
                "yes" if on["tokens_equal_cache_off"] else "NO",
            ]
        )
    head = [
        "mode",
        "reuse",
        "cache",
        "TTFT p50 (ms)",
        "TTFT p99 (ms)",
        "output tok/s",
        "KiB moved / request (mean, p50)",
        "cached tokens / request",
        "hit rate P / D",
    ]
    out = [*_table(head, rows), ""]
    out += _table(
        [
            "mode",
            "reuse",
            "TTFT p50 off/on",
            "output tok/s on/off",
            "bytes on/off (mean, p50)",
            "greedy tokens equal",
        ],
        ratios,
    )
    return "\n".join(out) + "\n"


def n_choices_markdown(report: dict[str, Any]) -> str:
    from bench.common import percentile

    length, rows = report["grid"]["prompt_lens"][0], []
    single = None
    for kind, title in (
        ("single", "one request"),
        ("n", f"`n = {report['args']['n']}`"),
        ("separate", f"{report['args']['n']} requests at once"),
    ):
        cells = [c for c in report["cells"] if c["series"] == kind]
        ttft = percentile([c["ttft_s"] for c in cells], 0.5)
        single = single or ttft
        prefills = (percentile([float(c["computed"]) for c in cells], 0.5) or 0) / length
        rows.append([title, _ms(ttft), f"{_div(ttft, single) or 0:.2f}", f"{prefills:.2f}"])
    return "\n".join(_table(["cell", "TTFT p50 (ms)", "against one request", "prefills"], rows)) + "\n"
