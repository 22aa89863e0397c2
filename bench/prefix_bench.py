"""The shared-prefix workload of the serving benchmark: the prefix cache on against off, in one run.

``python bench/serving_bench.py --workload shared-prefix`` runs it. Requests come in groups that
share the first ``reuse`` fraction of each prompt (a long system prompt or a multi-turn history);
the rest of each prompt is its own. Requests go round-robin over the groups, ``--concurrency`` in
flight (a closed loop), so the first request of each group finds nothing cached and the later ones
find its prefix. For each mode (PD READ, PD WRITE) a fresh 1P1D pipeline on the tiny preset runs
every reuse ratio with the cache off, and another with it on (the same prompts, in the same order),
side by side: their cells alternate, ``--repeats`` rounds with fresh prompts each.

Per (mode, cache, reuse): TTFT p50 / p99, output tok/s (output tokens over the workload's wall
time), KV bytes moved per request (D's read in READ, P's pushes in WRITE), the prompt tokens P found
cached (as ``usage.prompt_tokens_details.cached_tokens`` reports them), and P's and D's hit rates
(tokens found cached over tokens looked up, from the workers' stats); each against the cache off.
Writes bench/results/prefix_<tag>.json and .png.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from moriio_ray import PDPipeline, SamplingParams
from moriio_ray.config import parse_pipeline_config

MODES = ("read", "write")


def prompts_for(reuse: float, prompt_len: int, groups: int, group_size: int, seed: int) -> list[list[int]]:
    """``groups`` x ``group_size`` prompts of ``prompt_len`` byte tokens, the first ``reuse`` of each
    shared within its group; round-robin over the groups."""
    rng = random.Random(f"{seed}-{reuse}")
    shared_len = int(prompt_len * reuse)
    heads = [[rng.randrange(32, 127) for _ in range(shared_len)] for _ in range(groups)]
    out = []
    for _ in range(group_size):
        for head in heads:
            out.append(head + [rng.randrange(32, 127) for _ in range(prompt_len - shared_len)])
    return out


def pipeline_config(name: str, mode: str, cache: bool, prompt_len: int, concurrency: int) -> Any:
    blocks_per_prompt = -(-prompt_len // 16) + 4
    return parse_pipeline_config(
        {
            "name": name,
            "model": {"preset": "tiny", "seed": 0, "max_model_len": prompt_len + 256},
            "engine": {
                "device": "cpu",
                "block_size": 16,
                # room for every request in flight and a cache of a few groups' prefixes
                "num_blocks": blocks_per_prompt * (concurrency + 8),
                "max_num_seqs": 64,
                "enable_prefix_caching": cache,
            },
            "transfer": {"backend": "shm", "mode": mode},
            "pool": {"prefill": {"replicas": 1, "num_cpus": 0.5}, "decode": {"replicas": 1, "num_cpus": 0.5}},
        }
    )


def _cache_totals(pipe: PDPipeline) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for w in pipe.stats()["workers"].values():
        out[w["role"]] = dict(w["prefix_cache"])
    return out


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(pipe: PDPipeline, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> dict:
    """Run ``prompts`` through ``pipe``; what each request and the workers' caches saw."""
    before = _cache_totals(pipe)
    t0 = time.perf_counter()
    results = pipe.generate_batch(prompts, params, max_concurrency=concurrency)
    wall_s = time.perf_counter() - t0
    after = _cache_totals(pipe)
    deltas = {
        f"{key}_{role}": after[role][key] - before[role][key]
        for role in ("prefill", "decode")
        for key in ("num_hit_tokens", "num_queried_tokens")
    }
    return {
        "wall_s": wall_s,
        "ttft_s": [r.timings.ttft_s for r in results if r.timings.ttft_s is not None],
        "moved": [r.timings.transfer_bytes or 0 for r in results],
        "cached": [r.num_cached_tokens for r in results],
        "tokens": [r.token_ids for r in results],
        **deltas,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell from its repeats: the requests pooled, tok/s over their summed wall time."""
    ttft = [t for r in runs for t in r["ttft_s"]]
    moved = [b for r in runs for b in r["moved"]]
    tokens = [t for r in runs for t in r["tokens"]]

    def rate(role: str) -> float:
        queried = sum(r[f"num_queried_tokens_{role}"] for r in runs)
        return sum(r[f"num_hit_tokens_{role}"] for r in runs) / queried if queried else 0.0

    return {
        "num_requests": len(tokens),
        "wall_s": sum(r["wall_s"] for r in runs),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": _quantile(ttft, 0.99),
        "output_tok_s": sum(len(t) for t in tokens) / sum(r["wall_s"] for r in runs),
        "transfer_bytes_per_request": sum(moved) / len(moved),
        "transfer_bytes_p50": statistics.median(moved),  # a request after its group's first
        "cached_tokens_per_request": sum(c for r in runs for c in r["cached"]) / len(tokens),
        "hit_rate_prefill": rate("prefill"),
        "hit_rate_decode": rate("decode"),
        "tokens": tokens,
    }


def run(a: argparse.Namespace, tag: str, commit: str) -> dict[str, Any]:
    """Per mode, the cache-off and cache-on pipelines side by side, the cells alternating between
    them (``--repeats`` rounds, fresh prompts each), so that a change in the host's load meets both."""
    prompt_len, concurrency = a.prompt_lens[0], a.concurrency[0]
    params = SamplingParams(max_tokens=a.output_tokens, ignore_eos=True)
    warm = prompts_for(0.0, prompt_len, 2, 1, a.seed - 1)
    cells: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    import ray

    # a cluster of its own (a bare ray.init joins one that `ray start` left on this host)
    ray.init(
        address="local", num_cpus=4, namespace="moriio_ray", include_dashboard=False, log_to_driver=False
    )
    for mode in [m for m in MODES if m in a.modes]:
        pipes = {
            cache: PDPipeline.launch(
                pipeline_config(
                    f"prefix-{mode}-{'on' if cache else 'off'}", mode, cache, prompt_len, concurrency
                )
            )
            for cache in (False, True)
        }
        try:
            for pipe in pipes.values():
                pipe.generate_batch(warm, params, max_concurrency=concurrency)  # unrecorded
            raw: dict[tuple[bool, float], list[dict[str, Any]]] = {}
            for rep in range(a.repeats):
                for reuse in a.reuse:
                    prompts = prompts_for(reuse, prompt_len, a.groups, a.group_size, a.seed + rep)
                    for cache, pipe in pipes.items():
                        raw.setdefault((cache, reuse), []).append(measure(pipe, prompts, params, concurrency))
            for (cache, reuse), runs in raw.items():
                cell = summarize(runs)
                cell.update(mode=mode, cache=cache, reuse=reuse)
                cells.append(cell)
                print(_line(cell), flush=True)
        finally:
            for pipe in pipes.values():
                pipe.shutdown()
    for cell in cells:  # greedy tokens: the cache must not change one
        off = next(
            c for c in cells if (c["mode"], c["reuse"], c["cache"]) == (cell["mode"], cell["reuse"], False)
        )
        cell["tokens_equal_cache_off"] = cell["tokens"] == off["tokens"]
    for cell in cells:
        del cell["tokens"]
    return {
        "benchmark": "serving_bench --workload shared-prefix",
        "tag": tag,
        "commit": commit,
        "model": "tiny",
        "workload": {
            "prompt_len": prompt_len,
            "concurrency": concurrency,
            "output_tokens": a.output_tokens,
            "groups": a.groups,
            "group_size": a.group_size,
            "reuse": a.reuse,
            "repeats": a.repeats,
        },
        "cells": cells,
        "ratios": ratios(cells),
        "elapsed_s": time.perf_counter() - t_start,
    }


def ratios(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (mode, reuse): cache on over cache off."""
    out = []
    for on in [c for c in cells if c["cache"]]:
        off = next(
            c for c in cells if (c["mode"], c["reuse"], c["cache"]) == (on["mode"], on["reuse"], False)
        )
        out.append(
            {
                "mode": on["mode"],
                "reuse": on["reuse"],
                "ttft_p50_off_over_on": off["ttft_p50_s"] / on["ttft_p50_s"],
                "output_tok_s_on_over_off": on["output_tok_s"] / off["output_tok_s"],
                "transfer_bytes_on_over_off": on["transfer_bytes_per_request"]
                / off["transfer_bytes_per_request"],
                "transfer_bytes_p50_on_over_off": on["transfer_bytes_p50"] / off["transfer_bytes_p50"],
                "tokens_equal": on["tokens_equal_cache_off"],
            }
        )
    return out


def _line(c: dict[str, Any]) -> str:
    return (
        f"[{c['mode']} cache={'on' if c['cache'] else 'off'} reuse={c['reuse']:.0%}] "
        f"TTFT p50 {c['ttft_p50_s'] * 1e3:.1f} ms, {c['output_tok_s']:.0f} tok/s, "
        f"{c['transfer_bytes_per_request'] / 1024:.0f} KiB/request "
        f"(p50 {c['transfer_bytes_p50'] / 1024:.0f}), hit rate P {c['hit_rate_prefill']:.0%} "
        f"D {c['hit_rate_decode']:.0%}"
    )


def markdown(report: dict[str, Any]) -> str:
    rows = [
        "| mode | reuse | cache | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s | KiB moved / request "
        "(mean, p50) | cached tokens / request | hit rate P / D |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["cells"]:
        cache = "on" if c["cache"] else "off"
        kib = f"{c['transfer_bytes_per_request'] / 1024:.0f}, {c['transfer_bytes_p50'] / 1024:.0f}"
        hits = f"{c['hit_rate_prefill']:.0%} / {c['hit_rate_decode']:.0%}"
        rows.append(
            f"| {c['mode']} | {c['reuse']:.0%} | {cache} | {c['ttft_p50_s'] * 1e3:.1f} "
            f"| {c['ttft_p99_s'] * 1e3:.1f} | {c['output_tok_s']:.0f} | {kib} "
            f"| {c['cached_tokens_per_request']:.0f} | {hits} |"
        )
    rows += [
        "",
        "| mode | reuse | TTFT p50 off/on | output tok/s on/off | bytes on/off (mean, p50) | tokens equal |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["ratios"]:
        moved = f"{r['transfer_bytes_on_over_off']:.3f}, {r['transfer_bytes_p50_on_over_off']:.3f}"
        rows.append(
            f"| {r['mode']} | {r['reuse']:.0%} | {r['ttft_p50_off_over_on']:.2f}x "
            f"| {r['output_tok_s_on_over_off']:.3f} | {moved} | {r['tokens_equal']} |"
        )
    return "\n".join(rows)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("TTFT p50 (ms)", "ttft_p50_s", 1e3),
        ("output tokens/s", "output_tok_s", 1.0),
        ("KiB moved per request", "transfer_bytes_per_request", 1 / 1024),
        ("hit rate on P", "hit_rate_prefill", 1.0),
    )
    cells = report["cells"]
    groups = list(dict.fromkeys((c["mode"], c["reuse"]) for c in cells))
    labels = [f"{m} {r:.0%}" for m, r in groups]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (title, key, scale) in zip(axes, panels, strict=True):
        for k, cache in enumerate((False, True)):
            ys = [
                next(c[key] * scale for c in cells if (c["mode"], c["reuse"], c["cache"]) == (m, r, cache))
                for m, r in groups
            ]
            xs = [i + 0.4 * k for i in range(len(groups))]
            ax.bar(xs, ys, width=0.4, label=f"cache {'on' if cache else 'off'}")
        ax.set_xticks([i + 0.2 for i in range(len(groups))], labels, fontsize=8)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    w = report["workload"]
    fig.suptitle(
        f"shared-prefix workload: tiny on the CPU, {w['prompt_len']}-token prompts, "
        f"{w['groups']} groups x {w['group_size']}, c={w['concurrency']} ({report['commit']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"prefix_{report['tag']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    table = markdown(report)
    stem.with_suffix(".md").write_text(table + "\n")
    plot(report, stem.with_suffix(".png"))
    print("\n" + table, flush=True)
