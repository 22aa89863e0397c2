"""The serving yardstick: pipelines against the bare engine on the same device, in one run.

Systems, side by side on the same request stream: the bare engine (``Engine`` in this process,
CUDA graphs on), the colocated pipeline, and the PD pipeline (P and D sharing the device: half a
GPU each over cuda_ipc, or shm on the CPU) in READ and in WRITE mode. Each pipeline is measured
through the Python API (``PDPipeline.stream``) and through HTTP (the OpenAI front end,
``/v1/completions`` with ``stream: true`` and usage, read by the lean client of
bench/serving_client.py, spread over --client-procs processes whose CPU time is recorded), once
per Serve mode (--serve-modes): ``http`` through Serve's proxy actor, ``http-fast`` through
HAProxy and the replicas' direct ingress (moriio_ray/serve/serve_mode.py).

A cell is one concurrency c and one prompt length: a closed loop keeps c requests in flight (a new
one starts when one ends) until the cell's requests are done. Every request has a prompt of exactly
that many token ids and generates exactly --output-tokens tokens (greedy, EOS ignored). Timed on the
client, per request: TTFT (send to first token), TPOT ((last - first token) / (tokens - 1)), its
own tokens/s; per cell: output tok/s (all tokens over first send to last token), TPOT and TTFT
p50/p99, each also as a ratio to the bare engine at the same c and prompt length. The bare
engine's decode-only tok/s at batch --decode-batch is the denominator of the issue's goals.

The run keeps to --budget-s: a cell stops starting requests once its share of the time left is
spent (the requests in flight finish), so a slow system yields fewer requests, not a late run.

    python bench/serving_bench.py                 # GPU (llama-1b): the full grid within --budget-s
    python bench/serving_bench.py                 # CPU (tiny): engine, colocated, pd-read; c=1,32
    python bench/serving_bench.py --workload shared-prefix   # prefix cache on vs off (bench/prefix_bench.py)
    python bench/serving_bench.py --workload n-choices       # n choices vs n requests (n_choices_bench.py)

Writes bench/results/serving_<tag>.json (every request's numbers), .png and .md (the tables).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for bench and moriio_ray

from bench import serving_report
from bench.serving_run import Run
from bench.serving_series import all_pipelines, engine_series, probe_serve_process
from bench.serving_stats import RAW_COLUMNS, describe
from bench.serving_systems import PIPELINES, SYSTEMS, TRANSPORTS, pipeline_args, serve_args_of
from moriio_ray.serve.serve_mode import SERVE_MODES

ROOT = Path(__file__).resolve().parents[1]
T_START_S = time.perf_counter()  # the budget counts from here: torch, Ray and every start-up included


def csv(kind: type) -> Any:
    return lambda text: [kind(x) for x in text.split(",") if x]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--config", type=Path, help="Serve config every system derives from (default by device)")
    p.add_argument("--systems", type=csv(str), help=f"{','.join(SYSTEMS)} (CPU default: all but pd-write)")
    p.add_argument("--transports", type=csv(str), default=list(TRANSPORTS), help=",".join(TRANSPORTS))
    p.add_argument(
        "--serve-modes",
        type=csv(str),
        default=list(SERVE_MODES),
        help="HTTP through Serve's "
        "proxy (default) and through HAProxy direct ingress (fast): one series each",
    )
    p.add_argument(
        "--stream-intervals",
        type=csv(int),
        default=[],
        help="serve.stream_interval of the HTTP series (several: one series each; default the config's)",
    )
    p.add_argument("--concurrency", type=csv(int), help="default 1,8,32,64,128 (CPU: 1,32)")
    p.add_argument("--prompt-lens", type=csv(int), help="default 128,1024 (CPU: 128)")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--requests-factor", type=int, default=4, help="requests per cell: factor * c ...")
    p.add_argument("--min-requests", type=int, default=16, help="... and at least this many")
    p.add_argument("--warmup", type=int, default=8, help="unrecorded requests per prompt length and series")
    p.add_argument("--budget-s", type=float, default=420.0, help="the whole run, start-ups included")
    p.add_argument("--max-cell-s", type=float, default=30.0, help="no cell starts requests for longer")
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--start-timeout-s", type=float, default=180.0, help="each launch and deploy")
    p.add_argument("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 1) // 4)))
    p.add_argument("--http-server", default="inproc", choices=["inproc", "process"])
    p.add_argument("--probe-serve-process", action="store_true", help="also time one `serve run` start-up")
    p.add_argument("--ingress-replicas", type=int, default=1, help="Serve ingress replicas (HTTP callers)")
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--decode-repeats", type=int, default=3)
    p.add_argument(
        "--threads", type=int, default=0, help="CPU: the bare engine's torch threads (0: as a worker)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", help="output name serving_<tag>.*; default cpu or gpu")
    p.add_argument("--commit", help="the commit measured (default: git describe)")
    p.add_argument("--ray-logs", action="store_true", help="show the workers' logs on stdout")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--rewrite", type=Path, help="only redo the goals, tables and plot of this JSON")
    p.add_argument(
        "--workload",
        default="grid",
        choices=["grid", "shared-prefix", "n-choices"],
        help="grid: the systems above; shared-prefix: PD with the prefix cache on vs off "
        "(--prompt-lens and --concurrency: their first value; CPU defaults 1024 and 4); "
        "n-choices: one request of --n choices against --n separate ones, through HTTP",
    )
    p.add_argument("--n", type=int, default=4, help="n-choices: choices per request")
    p.add_argument("--rounds", type=int, default=5, help="n-choices: rounds of the three cells")
    p.add_argument("--reuse", type=csv(float), default=[0.9, 0.0], help="shared-prefix: shared fraction")
    p.add_argument("--groups", type=int, default=4, help="shared-prefix: groups of requests sharing a prefix")
    p.add_argument("--group-size", type=int, default=6, help="shared-prefix: requests per group")
    p.add_argument("--modes", type=csv(str), default=["read", "write"], help="shared-prefix: read,write")
    p.add_argument(
        "--repeats", type=int, default=2, help="shared-prefix: rounds of cells, off and on alternating"
    )
    return p


def check_args(a: argparse.Namespace, device: str) -> None:
    """Fill the defaults that depend on the device (the CPU check is the small grid), then check."""
    p, cpu = parser(), device == "cpu"
    a.systems = a.systems or [s for s in SYSTEMS if not (cpu and s == "pd-write")]
    a.concurrency = a.concurrency or ([1, 32] if cpu else [1, 8, 32, 64, 128])
    a.prompt_lens = a.prompt_lens or ([128] if cpu else [128, 1024])
    for name, allowed in (("systems", SYSTEMS), ("transports", TRANSPORTS), ("serve_modes", SERVE_MODES)):
        bad = [x for x in getattr(a, name) if x not in allowed]
        if bad or not getattr(a, name):
            p.error(f"--{name.replace('_', '-')}: {(bad or [''])[0]!r} is not one of {', '.join(allowed)}")
    if min(a.concurrency + a.prompt_lens + a.stream_intervals, default=1) < 1:
        p.error(
            "--concurrency, --prompt-lens and --stream-intervals: give positive integers, comma-separated"
        )
    if a.output_tokens < 2:
        p.error("--output-tokens: must be >= 2 (TPOT needs two tokens)")


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def environment(device: str) -> dict[str, Any]:
    import msgspec
    import ray
    import torch

    name = torch.cuda.get_device_name() if device == "cuda" else cpu_model()
    return {
        "host": platform.node(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "msgspec": msgspec.__version__,
        "device": name,
        "load_avg_1m_before": os.getloadavg()[0],
    }


def main() -> None:
    a = parser().parse_args()
    if a.rewrite:
        report = json.loads(a.rewrite.read_text())
        report["goals"] = serving_report.goals(report)
        write(report, a.rewrite.parent, report["tag"])
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still runs the clean-up below
    if a.workload == "shared-prefix":
        shared_prefix(a)
        return
    if a.workload == "n-choices":
        n_choices(a)
        return
    import torch
    import yaml

    device = "cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available()) else "cpu"
    check_args(a, device)
    tag = a.tag or ("gpu" if device == "cuda" else "cpu")
    default = "llama1b_1p1d_cuda.yaml" if device == "cuda" else "tiny_1p1d_cpu.yaml"
    config_path = a.config or ROOT / "configs" / default
    base_doc = yaml.safe_load(config_path.read_text())
    base_args = serve_args_of(config_path)
    # room for the largest cell and for the decode-only batch, in every engine alike
    sizes = {"max_concurrency": max(*a.concurrency, a.decode_batch), "max_prompt_len": max(a.prompt_lens)}
    max_output = max(a.output_tokens, a.decode_steps + 2)
    configs = {
        s: pipeline_args(
            base_args,
            s,
            gpu=device == "cuda",
            output_tokens=max_output,
            ingress_replicas=a.ingress_replicas,
            **sizes,
        )
        for s in PIPELINES
    }
    run = Run(a, device, configs, T_START_S)
    print(
        f"serving_bench on {device}: {len(run.series)} series x {len(run.grid)} cells, budget "
        f"{a.budget_s:.0f} s; estimated {run.estimate_s(1.0):.0f} s at the bare engine's speed, "
        f"{run.estimate_s(10.0):.0f} s with pipelines 10x slower (cells are time-boxed to the budget)",
        flush=True,
    )
    run.report.update(
        benchmark="serving_bench",
        tag=tag,
        commit=a.commit or git_commit(),
        model=(base_args.get("model") or {}).get("preset") or "custom",
        config=config_path.name,
        args={k: (v.name if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "out"},
        environment=environment(device),
        grid={
            "concurrency": a.concurrency,
            "prompt_lens": a.prompt_lens,
            "output_tokens": a.output_tokens,
            "requests_factor": a.requests_factor,
            "min_requests": a.min_requests,
        },
        http_series=[{"label": h[0], "serve_mode": h[1], "stream_interval": h[2]} for h in run.http],
        http_server=serving_report.HTTP_SERVER[a.http_server],
        notes=serving_report.NOTES,
        systems={
            "engine": {"config": configs["colocated"], "role": "colocated", "cuda_graphs": True},
            **{s: {"config": configs[s]} for s in PIPELINES},
        },
        raw_columns=RAW_COLUMNS,
    )
    pipes = [s for s in PIPELINES if s in a.systems]
    try:
        with tempfile.TemporaryDirectory(prefix="msb") as tmp:
            if "engine" in a.systems:
                try:
                    engine_series(run)
                except Exception as exc:
                    print(f"[engine] failed: {describe(exc)}", flush=True)
                    run.report["engine_error"] = describe(exc)
                    run.fail_series("engine", "python", f"engine failed: {describe(exc)}")
            if pipes:
                all_pipelines(run, Path(tmp), base_doc)
            if pipes and a.probe_serve_process:
                probe = probe_serve_process(configs[pipes[0]], Path(tmp), base_doc)
                run.report["startup_s"]["serve_process_probe"] = probe
    finally:
        run.report["cells"] = run.cells
        run.report["goals"] = serving_report.goals(run.report)
        run.report["elapsed_s"] = run.elapsed_s()
        run.report["environment"]["load_avg_1m_after"] = os.getloadavg()[0]
        write(run.report, a.out, tag)


def shared_prefix(a: argparse.Namespace) -> None:
    """The shared-prefix workload on the CPU (tiny preset): bench/prefix_bench.py."""
    from bench import prefix_bench

    a.prompt_lens = a.prompt_lens or [1024]
    a.concurrency = a.concurrency or [4]
    env = environment("cpu")  # the load average before the run
    report = prefix_bench.run(a, a.tag or "cpu", a.commit or git_commit())
    report["environment"] = env | {"load_avg_1m_after": os.getloadavg()[0]}
    prefix_bench.write(report, a.out)


def n_choices(a: argparse.Namespace) -> None:
    """n choices against n separate requests through `serve run` on the CPU: bench/n_choices_bench.py."""
    from bench import n_choices_bench

    a.prompt_len = (a.prompt_lens or [1024])[0]
    a.out.mkdir(parents=True, exist_ok=True)
    report = n_choices_bench.run(a, a.tag or "cpu", a.commit or git_commit())
    report["environment"] = environment("cpu")
    n_choices_bench.write(report, str(a.out))


def write(report: dict[str, Any], out: Path, tag: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"serving_{tag}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    table = serving_report.markdown(report)
    stem.with_suffix(".md").write_text(table)
    print("\n" + table + "\n" + serving_report.goals_text(report["goals"]), flush=True)
    try:
        from bench.serving_plot import plot

        plot(report, stem.with_suffix(".png"))
    except Exception as exc:  # the JSON is what matters; say why the picture is missing
        print(f"no plot: {describe(exc)}", flush=True)
    shown = stem.relative_to(ROOT) if stem.is_relative_to(ROOT) else stem.name
    print(f"wrote {shown}.json, .md and .png after {report['elapsed_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
