"""Engine scenarios of ``bench/engine_bench.py`` beyond raw throughput.

``long_prompt``: N requests decode at steady state; a long prompt arrives. The running requests'
inter-token gaps (their TPOT, sample by sample) before it arrives, while it is prefilled (the gaps
that overlap the time from its arrival to its first token) and while it decodes beside them, for
each engine configuration, in one run. The goal of issue 21: p99 of the gaps while it is
prefilled <= 2.0 x their p50 before.

``closed_loop``: c requests in flight at all times, of random prompt and output lengths; a finished
one is replaced at once. Generated tokens per second and the gaps, per configuration.

Each configuration is a fresh engine (``make``: name -> Engine). Times are wall clock when
``step`` returns, after a device synchronisation (the outputs are on the host then).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

from moriio_ray.config import EngineConfig, ModelConfig
from moriio_ray.engine.engine import Engine
from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.engine.sequence import blocks_for


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the closest ranks."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


class Clock:
    """Steps an engine, stamping every output token of each request with the step's return time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.stamps: dict[str, list[float]] = {}
        self.finished: set[str] = set()
        self.step_s: list[tuple[float, float]] = []  # (start, end) of each step

    def step(self) -> None:
        start = time.perf_counter()
        outputs = self.engine.step()
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
        now = time.perf_counter()
        self.step_s.append((start, now))
        for out in outputs:
            self.stamps.setdefault(out.request_id, []).extend([now] * len(out.new_token_ids))
            if out.finished:
                self.finished.add(out.request_id)

    def gaps(self, ids: list[str], start: float, end: float, *, overlapping: bool = False) -> list[float]:
        """Inter-token gaps (s) of ``ids`` within [start, end], or (``overlapping``) that overlap
        it at all: a gap that spans a whole prefill step counts for that step's window."""
        out = []
        for rid in ids:
            ts = self.stamps.get(rid, [])
            if overlapping:
                out += [b - a for a, b in itertools.pairwise(ts) if b > start and a < end]
            else:
                out += [b - a for a, b in itertools.pairwise(ts) if a >= start and b <= end]
        return out


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]


def long_prompt(
    make: Callable[[], Engine],
    *,
    running: int,
    running_len: int,
    long_len: int,
    baseline_steps: int = 32,
    seed: int = 0,
) -> dict[str, Any]:
    """One configuration's run of the scenario (see the module docstring)."""
    engine = make()
    clock = Clock(engine)
    rng = random.Random(seed)
    ids = [f"run{i}" for i in range(running)]
    decode = SamplingParams(max_tokens=engine.max_model_len - running_len - 1, ignore_eos=True)
    for rid in ids:
        engine.add_request(rid, _prompt(rng, running_len), decode)
    while any(len(clock.stamps.get(rid, [])) < 8 for rid in ids):  # prefilled, and warm
        clock.step()
    base_start = time.perf_counter()
    for _ in range(baseline_steps):
        clock.step()
    arrival = time.perf_counter()
    after_steps = baseline_steps  # then the long request decodes beside them
    engine.add_request(
        "long", _prompt(rng, long_len), SamplingParams(max_tokens=after_steps, ignore_eos=True)
    )
    while "long" not in clock.stamps:
        clock.step()
    first = clock.stamps["long"][0]
    while "long" not in clock.finished:
        clock.step()
    for rid in ids:
        engine.abort(rid)
    before = clock.gaps(ids, base_start, arrival)
    during = clock.gaps(ids, arrival, first, overlapping=True)
    after = clock.gaps(ids, first, clock.stamps["long"][-1])
    window_steps = sum(1 for start, _ in clock.step_s if arrival <= start < first)
    p50 = statistics.median(before)
    return {
        "tpot_before_ms": {"p50": 1e3 * p50, "p99": 1e3 * pct(before, 99), "n": len(before)},
        "tpot_during_ms": {
            "p50": 1e3 * pct(during, 50),
            "p99": 1e3 * pct(during, 99),
            "max": 1e3 * max(during),
            "n": len(during),
        },
        "tpot_after_ms": {"p50": 1e3 * pct(after, 50), "p99": 1e3 * pct(after, 99), "n": len(after)},
        "p99_during_over_p50_before": pct(during, 99) / p50,
        "long_ttft_ms": 1e3 * (first - arrival),
        "prefill_steps": window_steps,
        # one running request's token times (s since the arrival), for the plot
        "timeline": {
            rid: [round(t - arrival, 5) for t in clock.stamps[rid] if base_start < t] for rid in ids[:1]
        },
    }


def closed_loop(
    make: Callable[[], Engine],
    *,
    concurrency: int,
    num_requests: int,
    prompt_lens: tuple[int, int],
    output_lens: tuple[int, int],
    seed: int = 0,
) -> dict[str, Any]:
    """One configuration's closed loop: ``concurrency`` in flight, ``num_requests`` in all."""
    engine = make()
    clock = Clock(engine)
    rng = random.Random(seed)
    specs = [
        (_prompt(rng, rng.randint(*prompt_lens)), rng.randint(*output_lens)) for _ in range(num_requests)
    ]
    started, done = 0, 0
    t0 = time.perf_counter()
    while done < num_requests:
        while started < num_requests and started - done < concurrency:
            prompt, max_tokens = specs[started]
            engine.add_request(f"c{started}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            started += 1
        clock.step()
        done = len(clock.finished)
    elapsed = time.perf_counter() - t0
    ids = [f"c{i}" for i in range(num_requests)]
    gaps = clock.gaps(ids, t0, float("inf"))  # every gap
    generated = sum(len(clock.stamps[rid]) for rid in ids)
    return {
        "elapsed_s": elapsed,
        "generated_tok_s": generated / elapsed,
        "prompt_tok_s": sum(len(p) for p, _ in specs) / elapsed,
        "tpot_ms": {"p50": 1e3 * pct(gaps, 50), "p99": 1e3 * pct(gaps, 99)},
        "steps": len(clock.step_s),
    }


# ----------------------------------------------------------------------------------------------
# a scenario's run over its configurations, report and plot


def configurations(budgets: list[int], overlap: bool) -> list[tuple[str, dict[str, Any]]]:
    """(name, EngineConfig overrides): unchunked, chunked at each budget, with the engine's default
    scheduling; with ``overlap`` each of them synchronous and overlapped."""
    out: list[tuple[str, dict[str, Any]]] = [("unchunked", {"chunked_prefill": False})]
    out += [(f"chunked {b}", {"max_num_batched_tokens": b}) for b in budgets]
    if overlap:
        sync = [(name, {**kw, "overlap_scheduling": False}) for name, kw in out]
        out = sync + [(f"{name} + overlap", {**kw, "overlap_scheduling": True}) for name, kw in out]
    return out


def run_turns(runs: dict[str, Callable[[], dict[str, Any]]], repeats: int) -> dict[str, list[dict[str, Any]]]:
    """Each configuration ``repeats`` times, taking turns (drifting host load hits all alike)."""
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for i in range(repeats):
        for name, run in runs.items():
            samples[name].append(run())
            print(f"  {name} ({i + 1}/{repeats}): {summary(samples[name][-1])}", flush=True)
    return samples


def summary(r: dict[str, Any]) -> str:
    if "p99_during_over_p50_before" in r:
        b, d = r["tpot_before_ms"], r["tpot_during_ms"]
        return (
            f"TPOT p50 {b['p50']:.2f} ms before, p50/p99/max {d['p50']:.2f}/{d['p99']:.2f}/{d['max']:.2f} ms "
            f"during ({r['prefill_steps']} steps): p99/p50 {r['p99_during_over_p50_before']:.2f}; "
            f"long prompt TTFT {r['long_ttft_ms']:.0f} ms; TPOT p50/p99 while it decodes "
            f"{r['tpot_after_ms']['p50']:.2f}/{r['tpot_after_ms']['p99']:.2f} ms"
        )
    return (
        f"{r['generated_tok_s']:,.0f} generated tok/s, TPOT p50/p99 "
        f"{r['tpot_ms']['p50']:.2f}/{r['tpot_ms']['p99']:.2f} ms, {r['steps']} steps"
    )


def medians(runs: list[dict[str, Any]], keys: list[tuple[str, ...]]) -> dict[str, float]:
    out = {}
    for path in keys:
        values = []
        for r in runs:
            v: Any = r
            for k in path:
                v = v[k]
            values.append(v)
        out[".".join(path)] = statistics.median(values)
    return out


LONG_KEYS = [
    ("p99_during_over_p50_before",),
    ("tpot_before_ms", "p50"),
    ("tpot_before_ms", "p99"),
    ("tpot_during_ms", "p50"),
    ("tpot_during_ms", "p99"),
    ("tpot_during_ms", "max"),
    ("long_ttft_ms",),
    ("prefill_steps",),
    ("tpot_after_ms", "p50"),
    ("tpot_after_ms", "p99"),
]
LOOP_KEYS = [("generated_tok_s",), ("prompt_tok_s",), ("tpot_ms", "p50"), ("tpot_ms", "p99"), ("steps",)]


def plot(scenario: str, results: dict[str, Any], title: str, path: Any, goal: float = 2.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    if scenario == "long-prompt":
        ax = axes[0]
        for name in names:
            ts = next(iter(results[name]["runs"][-1]["timeline"].values()))
            ax.plot(ts[1:], [1e3 * (b - a) for a, b in itertools.pairwise(ts)], ".-", label=name)
        ax.axvline(0.0, color="grey", lw=0.8)
        ax.set_xlabel("time since the long prompt arrived (s)")
        ax.set_ylabel("a running request's inter-token gap (ms)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
        ratios = [results[n]["median"]["p99_during_over_p50_before"] for n in names]
        axes[1].bar(range(len(names)), ratios)
        axes[1].axhline(goal, color="red", ls="--", label=f"goal {goal}")
        axes[1].set_ylabel("TPOT p99 during the prefill / p50 before")
        axes[1].set_yscale("log")
        axes[1].legend()
    else:
        for ax, key, label in zip(
            axes, ("generated_tok_s", "tpot_ms.p99"), ("generated tokens/s", "TPOT p99 (ms)"), strict=True
        ):
            ax.bar(range(len(names)), [results[n]["median"][key] for n in names])
            ax.set_ylabel(label)
    for ax in axes[1:] if scenario == "long-prompt" else axes:
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ----------------------------------------------------------------------------------------------


def environment(engine: Engine, load_before: tuple[float, float, float]) -> dict[str, Any]:
    device_name = (
        torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else platform.processor()
    )
    return {
        "torch": torch.__version__,
        "device": device_name,
        "cpu_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m_before_after": [load_before[0], os.getloadavg()[0]],
    }


def write_report(a: argparse.Namespace, name: str, env: dict[str, Any], **fields: Any) -> Path:
    """The run's record as ``<a.out>/<name>.json`` (its args without the output folder: no machine
    paths in results); the path without suffix, for the plot beside it."""
    report = {
        "benchmark": "engine_bench" + (f" --scenario {a.scenario}" if a.scenario != "throughput" else ""),
        "args": {k: v for k, v in vars(a).items() if k != "out"},
        "environment": env,
        **fields,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / name
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    return stem


def main(a: argparse.Namespace) -> None:
    """The long-prompt or closed-loop scenario over its configurations (``engine_scenarios``)."""
    long = a.scenario == "long-prompt"
    max_model_len = a.long_prompt_len + 256 if long else a.prompt_range[1] + a.output_range[1] + 8
    if long:
        # a running request may decode one token per step of the whole prefill (1-token chunks)
        per_seq = blocks_for(a.running_prompt_len + a.long_prompt_len + 128, a.block_size)
        num_blocks = blocks_for(a.long_prompt_len + 64, a.block_size) + a.running * per_seq + 16
        max_num_seqs = a.running + 1
    else:
        num_blocks = a.concurrency * blocks_for(max_model_len, a.block_size) + 16
        max_num_seqs = a.concurrency
    fields = {f.name for f in msgspec.structs.fields(EngineConfig)}

    def make(overrides: dict[str, Any]) -> Callable[[], Engine]:
        def build() -> Engine:
            kw = {
                "max_num_seqs": max_num_seqs,
                "max_num_batched_tokens": max(a.unchunked_budget, max_num_seqs),
            }
            kw.update({k: v for k, v in overrides.items() if k in fields})  # an older engine: its own
            engine = Engine(
                ModelConfig(preset=a.preset, dtype=a.dtype, max_model_len=max_model_len),
                EngineConfig(
                    device=a.device, block_size=a.block_size, num_blocks=num_blocks, layout=a.layout, **kw
                ),
                role="colocated",
                cuda_graphs=not a.no_cuda_graphs,
            )
            engine.capture_graphs()
            return engine

        return build

    configs = configurations([int(b) for b in a.budgets.split(",") if b], a.overlap)
    runs: dict[str, Callable[[], dict[str, Any]]] = {}
    for name, overrides in configs:
        build = make(overrides)
        if long:
            runs[name] = functools.partial(
                long_prompt, build, running=a.running, running_len=a.running_prompt_len,
                long_len=a.long_prompt_len,
            )  # fmt: skip
        else:
            runs[name] = functools.partial(
                closed_loop, build, concurrency=a.concurrency, num_requests=a.num_requests,
                prompt_lens=tuple(a.prompt_range), output_lens=tuple(a.output_range),
            )  # fmt: skip
    load_before = os.getloadavg()
    for run in runs.values():
        run()  # warm-up, not counted
    samples = run_turns(runs, a.repeats)
    for rs in samples.values():  # the plot draws the last run's timeline; the others are not kept
        for r in rs[:-1]:
            r.pop("timeline", None)
    keys = LONG_KEYS if long else LOOP_KEYS
    results = {
        name: {"overrides": dict(configs)[name], "median": medians(rs, keys), "runs": rs}
        for name, rs in samples.items()
    }
    for name, r in results.items():
        print(f"{name}: median {r['median']}", flush=True)
    env = environment(make({})(), load_before)
    name = f"engine_{a.scenario}_{a.preset}_{a.device}_{a.dtype}{a.tag}"
    stem = write_report(a, name, env, engine_fields=sorted(fields), results=results)
    what = (
        f"{a.running} decoding, a {a.long_prompt_len}-token prompt arrives"
        if long
        else f"{a.concurrency} in flight, prompts {a.prompt_range}, outputs {a.output_range}"
    )
    title = f"{a.preset} {a.dtype} on {env['device'] or a.device}: {what}, median of {a.repeats}"
    plot(a.scenario, results, title, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and {stem}.png", flush=True)
