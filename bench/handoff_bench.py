"""Handoff overhead of a PD request, beside the colocated TTFT, in one run.

For each backend (and mode), a 1P1D pipeline serves --requests requests at each of the
--concurrency levels (1: one at a time; c > 1: c in flight, a new one as soon as one ends), with
max_tokens=2, so that every request goes through P, the transfer and D's first decode step:

    handoff = D accepts the request for decoding - P finished its prefill - raw KV transfer time

P's and D's timestamps are wall-clock times of the same host (both engines run on it). The raw
transfer time is the read's issue-to-complete time measured on D (READ), or P's wait for its
pushes after the last layer (WRITE). What remains is the control plane: the handle's trip back
through Ray, the call to D, D's block reservation, plan, release message and engine hand-over.
A colocated pipeline serves the same requests; its TTFT is the baseline a PD request competes with.
Under load the handoff also holds the waits that load causes (P's output stream, D's admission
behind the other requests' steps): it is what a request pays between P and D, not the transfer.

    python bench/handoff_bench.py                                    # shm and tcp, CPU, tiny preset
    python bench/handoff_bench.py --concurrency 1,16,64              # and under load
    python bench/handoff_bench.py --backends cuda_ipc --device cuda --num-gpus 1 --preset llama-1b

Writes bench/results/handoff_<tag>.json and .png.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray

from bench.record_paths import repo_path
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


KEYS = ("handoff_s", "handoff_rpc_s", "handoff_local_s", "transfer_s", "ttft_s", "push_wait_s")


def measure(
    args: argparse.Namespace, name: str, cfg: Any, levels: list[int]
) -> dict[int, dict[str, list[float]]]:
    """Timings of --requests requests at each concurrency level, on one pipeline."""
    pipe = PDPipeline.launch(cfg)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    prompt = [(7 * i) % 200 + 32 for i in range(args.prompt_len)]
    per_level: dict[int, dict[str, list[float]]] = {}
    try:
        for c in levels:
            out: dict[str, list[float]] = {k: [] for k in KEYS}
            pipe.generate_batch([prompt] * max(args.warmup, c), params, max_concurrency=c)
            done = 0
            while done < args.requests:  # in chunks, for progress output
                n = min(50 if c == 1 else max(50, 4 * c), args.requests - done)
                for r in pipe.generate_batch([prompt] * n, params, max_concurrency=c):
                    for key in out:
                        value = getattr(r.timings, key)
                        if value is not None:
                            out[key].append(value)
                done += n
                print(f"  {name} c={c}: {done}/{args.requests}", flush=True)
            per_level[c] = {k: v for k, v in out.items() if v}
    finally:
        pipe.shutdown()
    return per_level


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
    fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(names)), 4))
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
    ap.add_argument("--requests", type=int, default=200, help="per concurrency level")
    ap.add_argument("--concurrency", default="1", help="comma-separated levels, e.g. 1,16,64")
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
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency: {args.concurrency!r} is not a comma-separated list of integers")
    if any(c < 1 for c in levels):
        ap.error(f"--concurrency: every level must be >= 1, got {args.concurrency!r}")
    if not ray.is_initialized():
        ray.init(namespace="moriio_ray", include_dashboard=False, log_to_driver=False)
    results: dict[str, dict[str, float]] = {}

    def run_name(name: str, c: int) -> str:
        return name if levels == [1] else f"{name}-c{c}"  # one level: the names of earlier records

    print("colocated baseline", flush=True)
    first_backend = args.backends.split(",")[0]  # a colocated GPU engine needs a GPU-capable agent
    cfg = config(args, "hb-col", first_backend, "read", True)
    for c, samples in measure(args, "colocated", cfg, levels).items():
        results[run_name("colocated", c)] = {"concurrency": c, **summarize(samples)}
    for backend in args.backends.split(","):
        for mode in args.modes.split(","):
            name = f"{backend}-{mode}"
            print(name, flush=True)
            cfg = config(args, f"hb-{backend}-{mode}", backend, mode, False)
            for c, samples in measure(args, name, cfg, levels).items():
                results[run_name(name, c)] = {"concurrency": c, **summarize(samples)}
    for r in results.values():
        base_ttft_ms = results[run_name("colocated", int(r["concurrency"]))]["ttft_s_p50_ms"]
        if "handoff_s_p50_ms" in r:
            r["handoff_over_colocated_ttft_p50"] = r["handoff_s_p50_ms"] / base_ttft_ms
    tag = args.tag or f"{args.preset}_{args.device}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "args": {**vars(args), "out": repo_path(args.out)},
        "host": platform.node(),
        "python": platform.python_version(),
        "ray": ray.__version__,
        "unix_time": time.time(),
        "results": results,
    }
    (out / f"handoff_{tag}.json").write_text(json.dumps(doc, indent=2))
    plot(results, out / f"handoff_{tag}.png")
    print(f"{'run':<18}{'handoff p50':>12}{'p99':>9}{'transfer p50':>14}{'TTFT p50':>10}{'p99':>9}  (ms)")
    for name, r in results.items():
        print(
            f"{name:<18}{r.get('handoff_s_p50_ms', float('nan')):>12.3f}"
            f"{r.get('handoff_s_p99_ms', float('nan')):>9.3f}"
            f"{r.get('transfer_s_p50_ms', r.get('push_wait_s_p50_ms', float('nan'))):>14.3f}"
            f"{r['ttft_s_p50_ms']:>10.3f}{r['ttft_s_p99_ms']:>9.3f}"
        )


if __name__ == "__main__":
    main()
