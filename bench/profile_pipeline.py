"""Where a pipeline's time goes: py-spy samples of every worker (and this driver) under load.

Launches one pipeline (colocated, or PD in READ or WRITE), runs closed-loop requests at one
concurrency through ``PDPipeline.generate_batch`` while ``py-spy record --gil`` samples each worker
process, and prints, per process and thread, the share of GIL-holding samples and the functions
that hold it longest. Needs ``py-spy`` on PATH (``pip install py-spy``).

    python bench/profile_pipeline.py --mode read --concurrency 32               # CPU, tiny
    python bench/profile_pipeline.py --device cuda --preset llama-1b --mode read --concurrency 64

Writes <out>/profile_<mode>.json and the raw py-spy files beside it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for moriio_ray

import ray

from moriio_ray import PDPipeline, SamplingParams, parse_pipeline_config

SKIP = ("Thread._bootstrap", "Thread._bootstrap_inner", "Thread.run", "<module>")


def config(a: argparse.Namespace) -> Any:
    gpu = a.device == "cuda"
    role = {"replicas": 1, "num_cpus": 1.0 if gpu else 0.5, "num_gpus": 0.5 if gpu else 0.0}
    if a.mode == "colocated":
        pool = {"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "colocated": role}
    else:
        pool = {"prefill": dict(role), "decode": dict(role)}
    return parse_pipeline_config(
        {
            "name": f"profile-{a.mode}",
            "model": {"preset": a.preset, "max_model_len": a.prompt_len + a.output_tokens + 32},
            "engine": {
                "device": a.device,
                "num_blocks": 4096 if gpu else 1024,
                "max_num_seqs": a.concurrency,
            },
            "transfer": {
                "backend": "cuda_ipc" if gpu else "shm",
                "mode": "read" if a.mode == "colocated" else a.mode,
            },
            "pool": pool,
        }
    )


def summarize(path: Path, top: int) -> dict[str, Any]:
    """Per thread: GIL samples; per (thread, function): inclusive samples."""
    threads: collections.Counter[str] = collections.Counter()
    funcs: collections.Counter[tuple[str, str]] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0].split(":")[-1].strip()
        threads[thread] += n
        total += n
        for name in dict.fromkeys(fr.split(" (")[0] for fr in frames[1:]):
            if name not in SKIP:
                funcs[(thread, name)] += n
    return {
        "samples": total,
        "threads": dict(threads.most_common()),
        "top": [[t, f, n] for (t, f), n in funcs.most_common(top)],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("colocated", "read", "write"), default="read")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--waves", type=int, default=6, help="requests = waves x concurrency")
    p.add_argument("--seconds", type=int, default=6, help="py-spy duration (the load runs at least as long)")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--out", type=Path, default=Path("bench/results/profile"))
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    beside = Path(sys.executable).with_name("py-spy")
    spy = shutil.which("py-spy") or (str(beside) if beside.exists() else None)
    if spy is None:
        print("py-spy not found: measuring without profiles")
    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=None if a.device == "cuda" else 4)
    pipe = PDPipeline.launch(config(a))
    try:
        prompts = [
            [(i * 7 + j) % 200 + 10 for j in range(a.prompt_len)] for i in range(a.concurrency * a.waves)
        ]
        params = SamplingParams(max_tokens=a.output_tokens, ignore_eos=True)
        pipe.generate_batch(prompts[: a.concurrency], params, max_concurrency=a.concurrency)  # warm-up
        workers = {k: ray.get(pipe.coordinator.lookup.remote(k)) for k in pipe.stats()["workers"]}
        pids = {k: ray.get(m.info_ref).pid for k, m in workers.items()}
        pids["driver"] = os.getpid()
        procs = {}
        if spy is not None:
            for name, pid in pids.items():
                out = a.out / f"spy_{a.mode}_{name}.txt"
                cmd = [
                    spy,
                    "record",
                    "-p",
                    str(pid),
                    "-d",
                    str(int(a.seconds)),
                    "-r",
                    str(a.rate),
                    "-f",
                    "raw",
                ]
                cmd += ["-o", str(out), "--threads", "--gil", "--nonblocking"]
                procs[name] = (
                    subprocess.Popen(
                        cmd, stdout=subprocess.DEVNULL, stderr=(a.out / f"spy_{a.mode}_{name}.log").open("w")
                    ),
                    out,
                )
        t0 = time.perf_counter()
        results = []
        while time.perf_counter() - t0 < a.seconds:  # keep the load on while py-spy samples
            results += pipe.generate_batch(prompts, params, max_concurrency=a.concurrency)
        wall_s = time.perf_counter() - t0
        tokens = sum(len(r.token_ids) for r in results)
        tpot = [
            ((r.timings.total_s or 0.0) - (r.timings.ttft_s or 0.0)) / (len(r.token_ids) - 1) for r in results
        ]
        report: dict[str, Any] = {
            "mode": a.mode,
            "device": a.device,
            "preset": a.preset,
            "concurrency": a.concurrency,
            "output_tok_s": tokens / wall_s,
            "tpot_ms_p50": statistics.median(tpot) * 1e3,
            "ttft_ms_p50": statistics.median(r.timings.ttft_s or 0.0 for r in results) * 1e3,
            "stats": pipe.stats()["workers"],
            "profiles": {},
        }
        for name, (proc, out) in procs.items():
            proc.wait(timeout=a.seconds + 30)
            if out.exists():
                report["profiles"][name] = summarize(out, 30)
    finally:
        pipe.shutdown()
        ray.shutdown()
    path = a.out / f"profile_{a.mode}.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: v for k, v in report.items() if k not in ("profiles", "stats")}))
    for name, prof in report["profiles"].items():
        print(f"== {name}: {prof['samples']} GIL samples; threads {prof['threads']}")
        for thread, func, n in prof["top"][:14]:
            print(f"   {n:6d}  {thread[:22]:22s} {func}")


if __name__ == "__main__":
    main()
