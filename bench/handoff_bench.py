"""Handoff overhead of a PD request, beside the colocated TTFT, in one run.

For each backend (and mode), a 1P1D pipeline serves --requests requests one at a time
(max_tokens=2, so every request goes through P, the transfer and D's first decode step):

    handoff = D accepts the request for decoding - P finished its prefill - raw KV transfer time

P's and D's timestamps are wall-clock times of the same host (both engines run on it). The raw
transfer time is the read's issue-to-complete time measured on D (READ), or P's wait for its
pushes after the last layer (WRITE). What remains is the control plane: the handle's trip back
through Ray, the call to D, D's block reservation, plan, release message and engine hand-over.
A colocated pipeline serves the same requests; its TTFT is the baseline a PD request competes with.

    python bench/handoff_bench.py                                    # shm and tcp, CPU, tiny preset
    python bench/handoff_bench.py --backends cuda_ipc --device cuda --num-gpus 1 --preset llama-1b

Writes bench/results/handoff_<tag>.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray

from moriio_ray import PDPipeline, SamplingParams
from moriio_ray.config import parse_pipeline_config


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def config(args: argparse.Namespace, name: str, backend: str, mode: str, colocated: bool) -> Any:
    role = {"num_cpus": args.num_cpus, "num_gpus": args.num_gpus}
    pool = (
        {"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "colocated": {**role, "replicas": 1}}
        if colocated
        else {"prefill": {**role, "replicas": 1}, "decode": {**role, "replicas": 1}}
    )
    return parse_pipeline_config(
        {
            "name": name,
            "model": {"preset": args.preset, "dtype": args.dtype},
            "engine": {"device": args.device, "num_blocks": args.num_blocks, "layout": args.layout},
            "transfer": {"backend": backend, "mode": mode},
            "pool": pool,
        }
    )


def measure(args: argparse.Namespace, name: str, cfg: Any) -> dict[str, list[float]]:
    pipe = PDPipeline.launch(cfg)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    prompt = [(7 * i) % 200 + 32 for i in range(args.prompt_len)]
    keys = ("handoff_s", "handoff_rpc_s", "handoff_local_s", "transfer_s", "ttft_s", "push_wait_s")
    out: dict[str, list[float]] = {k: [] for k in keys}
    try:
        for i in range(args.warmup + args.requests):
            r = pipe.generate(token_ids=prompt, params=params)
            if i < args.warmup:
                continue
            for key in out:
                value = getattr(r.timings, key)
                if value is not None:
                    out[key].append(value)
            if (i - args.warmup + 1) % 50 == 0:
                print(f"  {name}: {i - args.warmup + 1}/{args.requests}", flush=True)
    finally:
        pipe.shutdown()
    return {k: v for k, v in out.items() if v}


def summarize(samples: dict[str, list[float]]) -> dict[str, float]:
    s: dict[str, float] = {}
    for key, values in samples.items():
        s[f"{key}_p50_ms"] = pct(values, 50) * 1e3
        s[f"{key}_p99_ms"] = pct(values, 99) * 1e3
        s[f"{key}_mean_ms"] = statistics.fmean(values) * 1e3
    return s


def plot(results: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(names))
    for offset, (key, label) in enumerate(
        [("handoff_s", "handoff"), ("transfer_s", "raw transfer"), ("ttft_s", "TTFT")]
    ):
        p50 = [results[n].get(f"{key}_p50_ms", 0.0) for n in names]
        p99 = [results[n].get(f"{key}_p99_ms", 0.0) for n in names]
        xs = [i + (offset - 1) * 0.27 for i in x]
        ax.bar(xs, p50, width=0.25, label=f"{label} p50")
        ax.scatter(xs, p99, marker="_", s=200, color="black")
    ax.set_xticks(list(x), names, rotation=15)
    ax.set_ylabel("ms (bars p50, ticks p99)")
    ax.set_title("PD handoff overhead vs colocated TTFT")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="shm,tcp")
    ap.add_argument("--modes", default="read,write")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layout", default="layer_major")
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--num-cpus", type=float, default=1.0)
    ap.add_argument("--num-gpus", type=float, default=0.0)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    if not ray.is_initialized():
        ray.init(namespace="moriio_ray", include_dashboard=False, log_to_driver=False)
    results: dict[str, dict[str, float]] = {}
    print("colocated baseline", flush=True)
    first_backend = args.backends.split(",")[0]  # a colocated GPU engine needs a GPU-capable agent
    results["colocated"] = summarize(
        measure(args, "colocated", config(args, "hb-col", first_backend, "read", True))
    )
    for backend in args.backends.split(","):
        for mode in args.modes.split(","):
            name = f"{backend}-{mode}"
            print(name, flush=True)
            cfg = config(args, f"hb-{backend}-{mode}", backend, mode, False)
            results[name] = summarize(measure(args, name, cfg))
    base_ttft_ms = results["colocated"]["ttft_s_p50_ms"]
    for r in results.values():
        if "handoff_s_p50_ms" in r:
            r["handoff_over_colocated_ttft_p50"] = r["handoff_s_p50_ms"] / base_ttft_ms
    tag = args.tag or f"{args.preset}_{args.device}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "args": {**vars(args), "out": os.path.relpath(args.out, Path(__file__).resolve().parents[1])},
        "host": platform.node(),
        "python": platform.python_version(),
        "ray": ray.__version__,
        "unix_time": time.time(),
        "results": results,
    }
    (out / f"handoff_{tag}.json").write_text(json.dumps(doc, indent=2))
    plot(results, out / f"handoff_{tag}.png")
    print(f"{'run':<14}{'handoff p50':>12}{'p99':>9}{'transfer p50':>14}{'TTFT p50':>10}{'p99':>9}  (ms)")
    for name, r in results.items():
        print(
            f"{name:<14}{r.get('handoff_s_p50_ms', float('nan')):>12.3f}"
            f"{r.get('handoff_s_p99_ms', float('nan')):>9.3f}"
            f"{r.get('transfer_s_p50_ms', r.get('push_wait_s_p50_ms', float('nan'))):>14.3f}"
            f"{r['ttft_s_p50_ms']:>10.3f}{r['ttft_s_p99_ms']:>9.3f}"
        )


if __name__ == "__main__":
    main()
