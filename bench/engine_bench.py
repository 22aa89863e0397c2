"""The built-in engine alone: throughput, and two scenarios, each configuration beside the others in
one run, taking turns (a drifting host load hits all alike), median of --repeats after a warm-up.

``--scenario throughput``: per batch size B, one step prefills B prompts of --prompt-len tokens,
then --decode-steps steps decode back to back (one synchronisation before and after). Beside the
engine: the ``transformers`` model of the same architecture (one forward, then a greedy loop with
its KV cache; --no-hf skips it), --baseline-kernels (the same engine on other kernels), --shaping
(penalties and logit_bias on every request).
``--scenario long-prompt``: --running requests decode at steady state, then a --long-prompt-len
prompt arrives: their inter-token gaps before, while it is prefilled and while it decodes, unchunked
against chunked at each of --budgets (--overlap: each also overlapped).
``--scenario closed-loop``: --concurrency in flight of random lengths; generated tok/s and gaps.

    python bench/engine_bench.py --preset llama-1b --device cuda --dtype bfloat16 --batch-sizes 1,64,128
    python bench/engine_bench.py --scenario long-prompt --threads 1 --repeats 5 --budgets 32,64

Writes <out>/engine[_<scenario>]_<preset>_<device>_<dtype>.json and .png.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for bench and moriio_ray

from bench.common import RESULTS, csv, median, percentile, pyplot, run_record, save, write_json
from bench.engine_hf import hf_model, hf_run, sync
from moriio_ray.config import EngineConfig, ModelConfig
from moriio_ray.engine.engine import Engine
from moriio_ray.engine.sampling import SamplingParams

# what --shaping puts on every request: the penalties and a logit bias
SHAPING: dict[str, Any] = dict(
    presence_penalty=0.5,
    frequency_penalty=0.5,
    repetition_penalty=1.1,
    logit_bias={t: 1.0 for t in range(0, 256, 16)},
)


def blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def engine_run(
    engine: Engine, batch: int, a: argparse.Namespace, seed: int, shaped: bool = False
) -> dict[str, float]:
    """One prefill step of ``batch`` prompts, then the decode steps back to back. With overlapped
    scheduling a step's tokens come back with the next step: the prefill ends with the step that
    returns the first tokens, the decode with the one that reads the last back."""
    params = SamplingParams(max_tokens=a.decode_steps + 1, ignore_eos=True, **(SHAPING if shaped else {}))
    gen = torch.Generator().manual_seed(seed + 1000)
    for i, prompt in enumerate(torch.randint(0, 256, (batch, a.prompt_len), generator=gen).tolist()):
        engine.add_request(f"b{batch}-s{seed}-{i}-{shaped}", prompt, params)
    sync(engine.device)
    start, num_first = time.perf_counter(), 0
    while num_first == 0:
        num_first = sum(len(o.new_token_ids) for o in engine.step())
    sync(engine.device)
    prefill_s, num_decoded = time.perf_counter() - start, 0
    assert num_first == batch, "prefill was split"
    start = time.perf_counter()
    while engine.has_work():
        num_decoded += sum(len(o.new_token_ids) for o in engine.step())
    sync(engine.device)
    decode_s = time.perf_counter() - start
    assert num_decoded == batch * a.decode_steps
    return {
        "prefill_tok_s": batch * a.prompt_len / prefill_s,
        "decode_tok_s": num_decoded / decode_s,
        "prefill_s": prefill_s,
        "decode_step_ms": 1e3 * decode_s / a.decode_steps,
    }


class Clock:
    """Steps an engine, stamping each output token of each request with the step's return time."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.stamps, self.finished = engine, dict[str, list[float]](), set[str]()
        self.steps: list[tuple[float, float]] = []

    def step(self) -> None:
        start = time.perf_counter()
        outputs = self.engine.step()
        sync(self.engine.device)
        now = time.perf_counter()
        self.steps.append((start, now))
        for out in outputs:
            self.stamps.setdefault(out.request_id, []).extend([now] * len(out.new_token_ids))
            if out.finished:
                self.finished.add(out.request_id)

    def gaps(self, ids: list[str], start: float, end: float, overlapping: bool = False) -> list[float]:
        """Inter-token gaps (s) of ``ids`` within [start, end], or that overlap it at all."""
        pairs = (p for rid in ids for p in itertools.pairwise(self.stamps.get(rid, [])))
        if overlapping:
            return [b - a for a, b in pairs if b > start and a < end]
        return [b - a for a, b in pairs if a >= start and b <= end]


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]


def _ms(values: list[float]) -> dict[str, float]:
    return {"p50": 1e3 * median(values), "p99": 1e3 * (percentile(values, 0.99) or 0.0), "n": len(values)}


def long_prompt(make: Callable[[], Engine], a: argparse.Namespace) -> dict[str, Any]:
    """Running requests decode; a long prompt arrives: their gaps before, during and after its prefill."""
    engine, rng = make(), random.Random(0)
    clock, ids = Clock(engine), [f"run{i}" for i in range(a.running)]
    decode = SamplingParams(max_tokens=engine.max_model_len - a.running_prompt_len - 1, ignore_eos=True)
    for rid in ids:
        engine.add_request(rid, _prompt(rng, a.running_prompt_len), decode)
    while any(len(clock.stamps.get(rid, [])) < 8 for rid in ids):  # prefilled, and warm
        clock.step()
    base_start = time.perf_counter()
    for _ in range(32):
        clock.step()
    arrival = time.perf_counter()
    engine.add_request(
        "long", _prompt(rng, a.long_prompt_len), SamplingParams(max_tokens=32, ignore_eos=True)
    )
    while "long" not in clock.finished:
        clock.step()
    for rid in ids:
        engine.abort(rid)
    first = clock.stamps["long"][0]
    before, during = clock.gaps(ids, base_start, arrival), clock.gaps(ids, arrival, first, overlapping=True)
    return {
        "tpot_before_ms": _ms(before),
        "tpot_during_ms": {**_ms(during), "max": 1e3 * max(during)},
        "tpot_after_ms": _ms(clock.gaps(ids, first, clock.stamps["long"][-1])),
        "p99_during_over_p50_before": (percentile(during, 0.99) or 0.0) / median(before),
        "long_ttft_ms": 1e3 * (first - arrival),
        "prefill_steps": sum(1 for start, _ in clock.steps if arrival <= start < first),
        "timeline": [round(t - arrival, 5) for t in clock.stamps[ids[0]] if base_start < t],  # for the plot
    }


def closed_loop(make: Callable[[], Engine], a: argparse.Namespace) -> dict[str, Any]:
    """``--concurrency`` in flight, ``--num-requests`` in all, of random prompt and output lengths."""
    engine, rng = make(), random.Random(0)
    clock, started = Clock(engine), 0
    lens = [(rng.randint(*a.prompt_range), rng.randint(*a.output_range)) for _ in range(a.num_requests)]
    specs = [(_prompt(rng, n), out) for n, out in lens]
    t0 = time.perf_counter()
    while len(clock.finished) < a.num_requests:
        while started < a.num_requests and started - len(clock.finished) < a.concurrency:
            params = SamplingParams(max_tokens=specs[started][1], ignore_eos=True)
            engine.add_request(f"c{started}", specs[started][0], params)
            started += 1
        clock.step()
    elapsed, ids = time.perf_counter() - t0, [f"c{i}" for i in range(a.num_requests)]
    rates = {"generated_tok_s": sum(len(clock.stamps[rid]) for rid in ids) / elapsed}
    rates["prompt_tok_s"] = sum(len(p) for p, _ in specs) / elapsed
    return {**rates, "tpot_ms": _ms(clock.gaps(ids, t0, float("inf"))), "steps": len(clock.steps)}


def turns(runs: dict[str, Callable[[], dict[str, Any]]], repeats: int) -> dict[str, list[dict[str, Any]]]:
    """One warm-up each (not counted), then ``repeats`` turns of every configuration."""
    for run in runs.values():
        run()
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for i in range(repeats):
        for name, run in runs.items():
            samples[name].append(run())
            shown = {k: v for k, v in samples[name][-1].items() if k != "timeline"}
            print(f"  {name} ({i + 1}/{repeats}): {shown}", flush=True)
    return samples


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The median of every number of the runs, by dotted key (timelines left out)."""
    flat = [
        {
            f"{k}.{q}" if isinstance(v, dict) else k: x
            for k, v in r.items()
            if k != "timeline"
            for q, x in (v.items() if isinstance(v, dict) else [("", v)])
        }
        for r in runs
    ]
    return {k: median([f[k] for f in flat]) for k in flat[0]}


def build(a: argparse.Namespace, max_model_len: int, num_blocks: int, **engine: Any) -> Engine:
    kw = {"overlap_scheduling": True} if a.overlap and "overlap_scheduling" not in engine else {}
    config = EngineConfig(
        device=a.device, block_size=a.block_size, num_blocks=num_blocks, layout=a.layout, **{**kw, **engine}
    )
    model = ModelConfig(preset=a.preset, dtype=a.dtype, max_model_len=max_model_len)
    built = Engine(model, config, role="colocated", cuda_graphs=not a.no_cuda_graphs)
    built.capture_graphs()
    return built


def throughput(a: argparse.Namespace) -> tuple[dict[str, Any], Callable[[Any, Path], None]]:
    batches, max_len = a.batch_sizes, a.prompt_len + a.decode_steps + 8
    size = {"max_num_seqs": max(batches), "max_num_batched_tokens": max(batches) * a.prompt_len}
    num_blocks = max(batches) * blocks(a.prompt_len + a.decode_steps + 1, a.block_size) + 16
    t0 = time.perf_counter()
    engine = build(a, max_len, num_blocks, kernels=a.kernels, **size)
    built_s, results = time.perf_counter() - t0, []
    baseline = (
        build(a, max_len, num_blocks, kernels=a.baseline_kernels, **size) if a.baseline_kernels else None
    )
    hf = None if a.no_hf else hf_model(engine)
    for batch in batches:
        runs: dict[str, Callable[[], dict[str, Any]]] = {}
        seeds = itertools.count()
        runs["engine"] = functools.partial(lambda b, s: engine_run(engine, b, a, next(s)), batch, seeds)
        if a.shaping:
            runs["engine-shaped"] = functools.partial(
                lambda b, s: engine_run(engine, b, a, next(s), shaped=True), batch, seeds
            )
        if baseline is not None:
            runs[f"engine-{a.baseline_kernels}"] = functools.partial(
                lambda b, s: engine_run(baseline, b, a, next(s)), batch, seeds
            )
        if hf is not None:
            runs["hf"] = functools.partial(
                lambda b, s: hf_run(hf, engine.device, b, a, next(s)), batch, seeds
            )
        print(f"batch {batch}: {', '.join(runs)}, {a.repeats} turns each", flush=True)
        row: dict[str, Any] = {
            "batch_size": batch,
            **{k: medians(v) for k, v in turns(runs, a.repeats).items()},
        }
        if a.shaping:
            row["shaping_decode_cost"] = (
                1 - row["engine-shaped"]["decode_tok_s"] / row["engine"]["decode_tok_s"]
            )
        if hf is not None:
            row["ratio"] = {k: row["engine"][k] / row["hf"][k] for k in ("prefill_tok_s", "decode_tok_s")}
        results.append(row)

    def plot(fig_axes: Any, path: Path) -> None:
        axes = fig_axes[1]
        names = [k for k in results[0] if isinstance(results[0][k], dict) and k != "ratio"]
        for ax, key in zip(axes, ("prefill_tok_s", "decode_tok_s"), strict=True):
            for k, name in enumerate(names):
                xs = [i + 0.8 / len(names) * k for i in range(len(batches))]
                ax.bar(xs, [r[name][key] for r in results], width=0.8 / len(names), label=name)
            ax.set(xticks=range(len(batches)), xticklabels=batches, ylabel=key, yscale="log")
            ax.legend()

    return {"engine_build_s": built_s, "results": results}, plot


def scenario(a: argparse.Namespace) -> tuple[dict[str, Any], Callable[[Any, Path], None]]:
    long = a.scenario == "long-prompt"
    if long:  # a running request may decode one token per step of the whole prefill (1-token chunks)
        max_len = a.long_prompt_len + 256
        num_seqs = a.running + 1
        per_seq = blocks(a.running_prompt_len + a.long_prompt_len + 128, a.block_size)
        num_blocks = blocks(a.long_prompt_len + 64, a.block_size) + a.running * per_seq + 16
    else:
        max_len, num_seqs = a.prompt_range[1] + a.output_range[1] + 8, a.concurrency
        num_blocks = a.concurrency * blocks(max_len, a.block_size) + 16
    configs: list[tuple[str, dict[str, Any]]] = [("unchunked", {"chunked_prefill": False})]
    configs += [(f"chunked {b}", {"max_num_batched_tokens": b}) for b in a.budgets]
    if a.overlap:
        configs = [(n, {**kw, "overlap_scheduling": False}) for n, kw in configs] + [
            (f"{n} + overlap", {**kw, "overlap_scheduling": True}) for n, kw in configs
        ]
    runs: dict[str, Callable[[], dict[str, Any]]] = {}
    for name, kw in configs:
        kw = {"max_num_seqs": num_seqs, "max_num_batched_tokens": max(a.unchunked_budget, num_seqs), **kw}
        make = functools.partial(build, a, max_len, num_blocks, **kw)
        runs[name] = functools.partial(long_prompt if long else closed_loop, make, a)
    samples = turns(runs, a.repeats)
    results: dict[str, dict[str, Any]] = {
        name: {"overrides": dict(configs)[name], "median": medians(rs), "runs": rs}
        for name, rs in samples.items()
    }
    for name, r in results.items():
        print(f"{name}: median {r['median']}", flush=True)
        for run in r["runs"][:-1]:  # the plot draws the last run's timeline
            run.pop("timeline", None)

    def plot(fig_axes: Any, path: Path) -> None:
        (_, (left, right)), names = fig_axes, list(results)
        key = "p99_during_over_p50_before" if long else "generated_tok_s"
        right.bar(range(len(names)), [results[n]["median"][key] for n in names])
        right.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        right.set_ylabel(key)
        for name in names if long else []:
            ts = results[name]["runs"][-1]["timeline"]
            left.plot(ts[1:], [1e3 * (b - a) for a, b in itertools.pairwise(ts)], ".-", label=name)
        left.set(
            xlabel="s since the long prompt arrived", ylabel="a running request's gap (ms)", yscale="log"
        )
        if long:
            left.legend(fontsize=8)

    return {"results": results}, plot


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--scenario", default="throughput", choices=["throughput", "long-prompt", "closed-loop"])
    add("--preset", default="tiny")
    add("--device", default="cpu", choices=["cpu", "cuda"])
    add("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add("--prompt-len", type=int, default=128)
    add("--decode-steps", type=int, default=64)
    add("--batch-sizes", type=csv(int), default=[1, 32, 128])
    add("--block-size", type=int, default=16)
    add("--layout", default="layer_major", choices=["layer_major", "block_major"])
    add("--repeats", type=int, default=3)
    add("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    add("--no-cuda-graphs", action="store_true", help="run decode steps eagerly on CUDA")
    add("--no-hf", action="store_true", help="skip the transformers baseline")
    add("--kernels", default="auto", choices=["auto", "torch", "triton"], help="engine.kernels")
    add("--baseline-kernels", default="", choices=["", "torch", "triton"], help="also an engine on these")
    add(
        "--shaping",
        action="store_true",
        help="also the engine with penalties and logit_bias on every request",
    )
    add(
        "--overlap",
        action="store_true",
        help="overlapped scheduling (scenarios: each configuration both ways)",
    )
    add("--running", type=int, default=16, help="long-prompt: requests decoding")
    add("--running-prompt-len", type=int, default=128)
    add("--long-prompt-len", type=int, default=4096)
    add("--budgets", type=csv(int), default=[256, 512], help="the chunked configurations' token budgets")
    add("--unchunked-budget", type=int, default=4096)
    add("--concurrency", type=int, default=16, help="closed-loop: requests in flight")
    add("--num-requests", type=int, default=96)
    add("--prompt-range", type=int, nargs=2, default=[32, 512])
    add("--output-range", type=int, nargs=2, default=[16, 128])
    add("--tag", default="", help="suffix of the result files")
    add("--out", type=Path, default=RESULTS)
    return p


def main() -> None:
    a = parser().parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)  # on a shared host, spinning OpenMP threads distort timings
    record = run_record(f"engine_bench --scenario {a.scenario}", vars(a))
    record["host"]["cpu_threads"] = torch.get_num_threads()
    fields, plot = (throughput if a.scenario == "throughput" else scenario)(a)
    scenario_name = "" if a.scenario == "throughput" else f"_{a.scenario}"
    eager = "_eager" if a.no_cuda_graphs and a.scenario == "throughput" else ""
    stem = a.out / f"engine{scenario_name}_{a.preset}_{a.device}_{a.dtype}{eager}{a.tag}"
    write_json(stem.with_suffix(".json"), {**record, **fields})
    fig_axes = pyplot().subplots(1, 2, figsize=(12, 4.4))
    plot(fig_axes, stem.with_suffix(".png"))
    save(
        fig_axes[0],
        stem.with_suffix(".png"),
        f"{a.preset} {a.dtype} on {a.device}: {a.scenario}, median of {a.repeats}",
    )
    print(f"wrote {stem}.json and .png", flush=True)


if __name__ == "__main__":
    main()
