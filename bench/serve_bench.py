"""HTTP load on the OpenAI front end: 1P1D against two colocated replicas, same hardware, same run.

For each system the script starts ``serve run`` on its config itself (a private Ray cluster in a
child process), waits for ``/health``, sends a few warm-up requests, then, for each rate in
--rates, replays the same request schedule: Poisson arrivals at that many requests/s, a mix of
short and long prompts (--long-fraction of them long), every request streaming
``/v1/completions`` with ``ignore_eos`` and the same --max-tokens, so both systems generate
exactly the same tokens' worth of work. A low rate shows latency under light load; a high one
saturates the box and shows throughput.

Measured on the client, per request: TTFT (send to the first SSE token chunk); TPOT (time per
output token after the first: (last token - first token) / (tokens - 1)); inter-token latency
(every gap between token-carrying chunks, split evenly over the tokens of the later chunk;
``logprobs: 0`` says how many tokens a chunk holds; chunks that arrive in one read give gaps near
zero); end-to-end latency. Per run: output tokens/s and requests/s from the first send to the
last token. The systems: the disaggregated config (default configs/tiny_1p1d_cpu.yaml: 1 prefill +
1 decode engine) and the same file with its pool replaced by 2 colocated engines of the same size.

    python bench/serve_bench.py                      # CPU, tiny preset; about 5 minutes on 2 cores
    python bench/serve_bench.py --num-requests 400 --rates 2,8,32

Writes bench/results/serve_<tag>.json and .png (tag: --tag, default cpu).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for moriio_ray

from bench.record_paths import repo_path
from moriio_ray import load_config
from moriio_ray.serve.process import ServeProcess

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Planned:
    """One request of the schedule (identical for every system)."""

    at_s: float  # send time, from the start of the run
    prompt: str
    long: bool


@dataclass
class Outcome:
    """What the client saw for one request."""

    long: bool
    status: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    num_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    sent_s: float = 0.0  # from the start of the run
    done_s: float = 0.0
    error: str | None = None


def make_schedule(args: argparse.Namespace, rate: float) -> list[Planned]:
    rng = random.Random(args.seed)
    at_s, plan = 0.0, []
    alphabet = "abcdefghijklmnopqrstuvwxyz     .,"
    for _ in range(args.num_requests):
        at_s += rng.expovariate(rate)
        long = rng.random() < args.long_fraction
        low, high = (args.long_len, args.long_len * 2) if long else (args.short_len, args.short_len * 2)
        length = rng.randint(low, high)
        plan.append(Planned(at_s=at_s, prompt="".join(rng.choices(alphabet, k=length)), long=long))
    return plan


async def one_request(http: httpx.AsyncClient, url: str, p: Planned, max_tokens: int, t0: float) -> Outcome:
    out = Outcome(long=p.long)
    body = {
        "prompt": p.prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "logprobs": 0,
        "stream": True,
    }
    start = time.perf_counter()
    out.sent_s = start - t0
    last = first = start
    try:
        async with http.stream("POST", url, json=body) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                out.error = (await resp.aread()).decode(errors="replace")[:300]
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = chunk["error"]["message"]
                    break
                lps = chunk["choices"][0]["logprobs"] if chunk["choices"] else None
                num = len(lps["tokens"]) if lps else 0
                if num == 0:
                    continue
                now = time.perf_counter()
                if out.ttft_s is None:
                    out.ttft_s, first = now - start, now
                    num_rest = num - 1  # tokens that came together with the first one
                else:
                    num_rest = num
                if num_rest > 0 and out.num_tokens > 0:
                    out.itl_s.extend([(now - last) / num_rest] * num_rest)
                out.num_tokens += num
                last = now
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    out.e2e_s, out.done_s = end - start, end - t0
    if out.num_tokens > 1:
        out.tpot_s = (last - first) / (out.num_tokens - 1)
    return out


async def run_load(base_url: str, plan: list[Planned], max_tokens: int, num_warmup: int) -> list[Outcome]:
    url = base_url + "/v1/completions"
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        if num_warmup:
            t_warm = time.perf_counter()
            await asyncio.gather(*(one_request(http, url, p, 8, t_warm) for p in plan[:num_warmup]))
        t0 = time.perf_counter()

        async def at(p: Planned) -> Outcome:
            await asyncio.sleep(max(0.0, p.at_s - (time.perf_counter() - t0)))
            return await one_request(http, url, p, max_tokens, t0)

        return list(await asyncio.gather(*(at(p) for p in plan)))


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"p50": pick(0.50), "p99": pick(0.99), "mean": statistics.fmean(ordered)}


def _ok(o: Outcome) -> bool:
    return o.status == 200 and o.error is None and o.ttft_s is not None


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    ok = [o for o in outcomes if _ok(o)]
    span_s = max((o.done_s for o in ok), default=0.0) - min((o.sent_s for o in outcomes), default=0.0)
    tokens = sum(o.num_tokens for o in ok)
    return {
        "num_requests": len(outcomes),
        "num_ok": len(ok),
        "num_errors": len(outcomes) - len(ok),
        "errors": sorted({f"{o.status}: {o.error}" for o in outcomes if not _ok(o)})[:5],
        "output_tokens": tokens,
        "span_s": span_s,
        "output_tokens_per_s": tokens / span_s if span_s > 0 else 0.0,
        "requests_per_s": len(ok) / span_s if span_s > 0 else 0.0,
        "ttft_s": percentiles([o.ttft_s for o in ok if o.ttft_s is not None]),
        "ttft_short_s": percentiles([o.ttft_s for o in ok if o.ttft_s is not None and not o.long]),
        "ttft_long_s": percentiles([o.ttft_s for o in ok if o.ttft_s is not None and o.long]),
        "tpot_s": percentiles([o.tpot_s for o in ok if o.tpot_s is not None]),
        "itl_s": percentiles([x for o in ok for x in o.itl_s]),
        "e2e_s": percentiles([o.e2e_s for o in ok if o.e2e_s is not None]),
    }


def colocated_variant(config: Path, work_dir: Path) -> Path:
    """The same Serve config with its pool replaced by colocated engines of the same count and size."""
    doc = yaml.safe_load(config.read_text())
    args = doc["applications"][0]["args"]
    pool = args.setdefault("pool", {})
    prefill, decode = pool.get("prefill", {}), pool.get("decode", {})
    count = int(prefill.get("replicas", 1)) + int(decode.get("replicas", 1))
    engine = {k: v for k, v in prefill.items() if k != "replicas"}
    pool.update(
        {"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "colocated": {**engine, "replicas": count}}
    )
    args["name"] = f"{args.get('name', 'default')}-colocated{count}"
    path = work_dir / f"{config.stem}_colocated{count}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    load_config(path)  # fail here, not in the child, if the variant is invalid
    return path


def run_system(name: str, config: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Start ``serve run`` on ``config`` and run every rate of the sweep against it."""
    print(f"[{name}] serve run {config.name} ...", flush=True)
    runs: dict[str, Any] = {}
    with ServeProcess(config) as server:
        for i, rate in enumerate(args.rates):
            plan = make_schedule(args, rate)
            t0 = time.perf_counter()
            outcomes = asyncio.run(
                run_load(server.base_url, plan, args.max_tokens, args.warmup if i == 0 else 0)
            )
            summary = summarize(outcomes)
            summary["raw"] = [asdict(o) | {"itl_s": None} for o in outcomes]
            runs[str(rate)] = summary
            print(
                f"[{name}] rate {rate}/s: {len(plan)} requests in {time.perf_counter() - t0:.1f} s, "
                f"{summary['num_errors']} errors",
                flush=True,
            )
        status, stats = server.get("/stats")
    return {
        "config": repo_path(config),
        "workers": sorted(stats["workers"]) if status == 200 else [],
        "rates": runs,
    }


def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    """a / b for each headline number (below 1 means a is faster for latencies, slower for rates)."""

    def div(x: float | None, y: float | None) -> float | None:
        return x / y if x is not None and y else None

    out: dict[str, float | None] = {}
    for metric in ("ttft_s", "ttft_short_s", "ttft_long_s", "tpot_s", "itl_s", "e2e_s"):
        for q in ("p50", "p99"):
            out[f"{metric}.{q}"] = div(a[metric][q], b[metric][q])
    out["output_tokens_per_s"] = div(a["output_tokens_per_s"], b["output_tokens_per_s"])
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = results["systems"]
    rates = [str(r) for r in results["load"]["rates"]]
    panels = [
        ("TTFT (ms)", "ttft_s", 1e3),
        ("time per output token (ms)", "tpot_s", 1e3),
        ("inter-token latency (ms)", "itl_s", 1e3),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    for ax, (title, metric, scale) in zip(axes, panels, strict=False):
        for name, res in systems.items():
            for q, style in (("p50", "-o"), ("p99", "--s")):
                ys = [(res["rates"][r][metric][q] or float("nan")) * scale for r in rates]
                ax.plot([float(r) for r in rates], ys, style, label=f"{name} {q}")
        ax.set(title=title, xlabel="offered load (requests/s)", yscale="log")
    for name, res in systems.items():
        ys = [res["rates"][r]["output_tokens_per_s"] for r in rates]
        axes[3].plot([float(r) for r in rates], ys, "-o", label=name)
    axes[3].set(title="output throughput (tokens/s)", xlabel="offered load (requests/s)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    load = results["load"]
    fig.suptitle(
        f"serve_bench ({results['host']['cpus']} CPUs): {load['num_requests']} requests per rate, Poisson "
        f"arrivals, {load['long_fraction']:.0%} long prompts, {load['max_tokens']} output tokens each"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny_1p1d_cpu.yaml")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument(
        "--rates",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[2.0, 16.0],
        help="offered loads to sweep, mean arrivals per second (Poisson), comma-separated",
    )
    parser.add_argument("--long-fraction", type=float, default=0.25)
    parser.add_argument("--short-len", type=int, default=32, help="short prompts: this to 2x tokens")
    parser.add_argument("--long-len", type=int, default=512, help="long prompts: this to 2x tokens")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="cpu")
    args = parser.parse_args()

    results: dict[str, Any] = {
        "load": {k: (repo_path(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "host": {"machine": platform.machine(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "systems": {},
    }
    disagg, coloc = "1P1D", "2x colocated"
    with tempfile.TemporaryDirectory(prefix="mrb") as tmp:
        colocated = colocated_variant(args.config, Path(tmp))
        results["systems"][disagg] = run_system(disagg, args.config, args)
        results["systems"][coloc] = run_system(coloc, colocated, args)
    results["ratios_1p1d_over_colocated"] = {
        str(rate): ratios(
            results["systems"][disagg]["rates"][str(rate)], results["systems"][coloc]["rates"][str(rate)]
        )
        for rate in args.rates
    }

    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / f"serve_{args.tag}.json", out_dir / f"serve_{args.tag}.png"
    json_path.write_text(json.dumps(results, indent=1))
    plot(results, png_path)
    for rate in args.rates:
        for name, sys_res in results["systems"].items():
            res = sys_res["rates"][str(rate)]
            print(
                f"rate {rate:>5}/s {name:>13}: ok {res['num_ok']}/{res['num_requests']}  "
                f"TTFT p50 {_ms(res['ttft_s']['p50'])} p99 {_ms(res['ttft_s']['p99'])}  "
                f"TPOT p50 {_ms(res['tpot_s']['p50'])} p99 {_ms(res['tpot_s']['p99'])}  "
                f"ITL p50 {_ms(res['itl_s']['p50'])} p99 {_ms(res['itl_s']['p99'])}  "
                f"{res['output_tokens_per_s']:.0f} tok/s"
            )
        ratio = results["ratios_1p1d_over_colocated"][str(rate)]
        print(f"rate {rate:>5}/s 1P1D / colocated:", {k: round(v, 3) for k, v in ratio.items() if v})
    print(f"wrote {json_path.relative_to(ROOT)} and {png_path.relative_to(ROOT)}")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


if __name__ == "__main__":
    main()
