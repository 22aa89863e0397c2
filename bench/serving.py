"""The serving benchmark: system x transport x load in one harness, the same requests for each.

Systems: ``engine`` (the bare ``Engine`` stepped here, CUDA graphs on), ``colocated``, ``read`` and
``write`` (1P1D; on a GPU P and D share it), derived from one Serve config (--config) by
``bench.common.pipeline_args``. Transports: ``python`` (``PDPipeline.stream`` in this driver's Ray)
and ``http`` (``serve run`` of the derived config, per --serve-modes; streamed with usage, read by
bench/http_client.py's client processes). Loads: closed loop at each --concurrency, Poisson arrivals
at each --rates. A cell (a load, a prompt length) has max(--requests, --waves x c) requests of
exactly --output-tokens greedy tokens. Per cell: TTFT, TPOT, output tok/s (p50/p99 by
bench.common.percentile) and, through the Python API, the handoff breakdown of the last stream
event's Timings. --profile: ``py-spy record --gil`` on this process and every Ray actor below it
during each series. Workloads: ``random``; ``shared-prefix`` (groups sharing a prefix, the prefix
cache off and on side by side); ``n-choices`` (one request of --n choices against --n requests).

    python bench/serving.py                                   # CPU: tiny; engine, colocated, read
    python bench/serving.py --systems read --concurrency 4 --requests 16 --profile
    python bench/serving.py --workload shared-prefix          # or n-choices
    python -m bench.report bench/results/serving_cpu.json     # the tables again

Writes <out>/serving_<tag>.json (every request), .md and .png (prefix_*, n_choices_* by workload).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for bench and moriio_ray

from bench import cpu_account
from bench import report as rep
from bench.common import (
    RESULTS,
    ROOT,
    csv,
    describe,
    pipeline_args,
    run_record,
    serve_doc,
    write_json,
)
from bench.http_client import Record
from bench.serving_cells import http_cell, python_cell, run_series, served_models
from bench.serving_engine import BareEngine
from bench.serving_stats import RAW_COLUMNS

SYSTEMS = ("engine", "colocated", "read", "write")
TRANSPORTS, MODES = ("python", "http"), ("default", "fast")
SERIES = {"colocated": "colocated", "read": "pd-read", "write": "pd-write"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--workload", default="random", choices=["random", "shared-prefix", "n-choices"])
    add("--device", default="auto", choices=["auto", "cpu", "cuda"])
    add("--config", type=Path, help="the Serve config every system derives from (default by device)")
    add("--url", help="a server already running (http://host:port): drive it over HTTP, start nothing")
    add("--systems", type=csv(str), help=f"{','.join(SYSTEMS)} (CPU default: engine,colocated,read)")
    add("--transports", type=csv(str), default=list(TRANSPORTS), help=",".join(TRANSPORTS))
    add("--serve-modes", type=csv(str), default=list(MODES), help="http: Serve's proxy, HAProxy")
    add("--backends", type=csv(str), help="PD transfer backends, one series each (default cuda_ipc / shm)")
    add("--colocated-replicas", type=int, default=1, help="engines of the colocated system")
    add("--set", action="append", default=[], metavar="KEY=VALUE", help="e.g. serve.num_replicas=4")
    add("--concurrency", type=csv(int), help="closed-loop cells (default 1,8,32,64,128; CPU 1,32)")
    add("--rates", type=csv(float), default=[], help="Poisson cells, requests/s")
    add("--prompt-lens", type=csv(int), help="default 128,1024 (CPU 128)")
    add("--long-fraction", type=float, default=0.0, help="mixed: long ones [L, 2L], the rest [len, 2 len]")
    add("--long-len", type=int, default=512)
    add("--output-tokens", type=int, default=64)
    add("--requests", type=int, default=16, help="requests per cell: at least this many ...")
    add("--waves", type=int, default=4, help="... and, closed loop, this many times c")
    add("--warmup", type=int, default=8, help="unrecorded requests per series and prompt length")
    add("--request-timeout-s", type=float, default=60.0)
    add("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 1) // 4)))
    add("--decode-batch", type=int, default=64, help="engine: decode-only tok/s at this batch (0: skip)")
    add("--decode-steps", type=int, default=64)
    add("--threads", type=int, default=0, help="CPU: the bare engine's torch threads (0: as a worker)")
    add("--profile", action="store_true", help="py-spy on every worker during each series' cells")
    add("--profile-rate", type=int, default=250, help="py-spy samples per second")
    add("--groups", type=int, default=4, help="shared-prefix: groups of requests sharing a prefix")
    add("--group-size", type=int, default=6, help="shared-prefix: requests per group")
    add("--reuse", type=csv(float), default=[0.9, 0.0], help="shared-prefix: shared fraction")
    add("--repeats", type=int, default=2, help="shared-prefix: rounds, cache off and on alternating")
    add("--n", type=int, default=4, help="n-choices: choices per request")
    add("--rounds", type=int, default=5, help="n-choices: rounds of the three cells")
    add("--seed", type=int, default=0)
    add("--tag", help="output name <kind>_<tag>.*; default cpu or gpu")
    add("--commit", help="the commit measured (default: git describe)")
    add("--ray-logs", action="store_true", help="the workers' logs on stdout")
    add("--out", type=Path, default=RESULTS)
    return p


def defaults(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Fill the defaults that depend on the device and the workload, then check the flags."""
    cpu, w = a.device == "cpu", a.workload
    a.config = a.config or ROOT / "configs" / ("tiny_1p1d_cpu.yaml" if cpu else "llama1b_1p1d_cuda.yaml")
    first = {"random": ["engine", "colocated", "read"] if cpu else list(SYSTEMS), "n-choices": ["read"]}
    a.systems = a.systems or first.get(w, ["read", "write"])
    closed = [4] if w == "shared-prefix" else [1, 32] if cpu else [1, 8, 32, 64, 128]
    a.concurrency = a.concurrency if a.concurrency is not None else [] if a.rates else closed
    a.prompt_lens = a.prompt_lens or ([1024] if w != "random" else [128] if cpu else [128, 1024])
    a.backends = a.backends or ["shm" if cpu else "cuda_ipc"]
    a.tag = a.tag or ("cpu" if cpu else "gpu")
    if a.url is not None:
        if w != "random" or not a.url.startswith(("http://", "https://")):
            p.error("--url: an http:// address, with the random workload only")
        a.url, a.systems, a.transports, a.serve_modes = a.url.rstrip("/"), [], ["http"], []
    for name, allowed in (("systems", SYSTEMS), ("transports", TRANSPORTS), ("serve_modes", MODES)):
        if bad := [x for x in getattr(a, name) if x not in allowed]:
            p.error(f"--{name.replace('_', '-')}: {bad[0]!r} is not one of {', '.join(allowed)}")
    if min(a.concurrency + a.prompt_lens + a.rates, default=1) <= 0 or a.output_tokens < 2:
        p.error("--concurrency, --rates, --prompt-lens: positive; --output-tokens: at least 2")


def fail(report: dict[str, Any], series: str, why: str) -> None:
    print(f"[{series}] {why}", flush=True)
    report["cells"].append({"series": series, "load": None, "prompt_len": None, "error": why})


def start_ray(a: argparse.Namespace) -> None:
    import ray

    if not ray.is_initialized():  # a cluster of its own (a bare ray.init joins one that `ray start` left)
        cpus = None if a.device == "cuda" else max(4, os.cpu_count() or 1)
        kw = {"namespace": "moriio_ray", "include_dashboard": False, "log_to_driver": a.ray_logs}
        ray.init(address="local", num_cpus=cpus, **kw)


def serve_file(a: argparse.Namespace, args: dict[str, Any], mode: str, work: Path) -> Path:
    """A Serve config file: --config's, with ``args`` as its application's and Serve in ``mode``."""
    from moriio_ray.serve.serve_mode import with_mode

    doc = with_mode(serve_doc(a.config), mode)
    doc["applications"][0]["args"] = args
    path = work / f"{args['name']}-{mode}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def system_args(a: argparse.Namespace, system: str, backend: str | None = None, *sets: str) -> dict[str, Any]:
    """``system``'s pipeline args from --config: room for the largest cell, then ``sets`` and --set."""
    base = serve_doc(a.config)["applications"][0].get("args") or {}
    longest = 2 * max(*a.prompt_lens, a.long_len) if a.long_fraction else max(a.prompt_lens)
    open_loop = 64 if a.rates else 1  # room for the requests that Poisson arrivals pile up
    size = {"max_concurrency": max([*a.concurrency, a.decode_batch, open_loop]), "max_prompt_len": longest}
    size["output_tokens"] = max(a.output_tokens, a.decode_steps + 2)
    kw = {"backend": backend, "gpu": a.device == "cuda", "colocated_replicas": a.colocated_replicas}
    return pipeline_args(base, system, **kw, **size, overrides=[*sets, *a.set])


def random_workload(a: argparse.Namespace, report: dict[str, Any], work: Path) -> None:
    from bench.launch import ServeProcess

    if a.url is not None:  # a server someone else started: its model and config are its own
        report["server"] = {"url": a.url, "models": served_models(a.url)}
        asyncio.run(run_series(a, report, "server/http", http_cell(a.url, a)))
        return

    if "engine" in a.systems:
        try:
            if a.device == "cpu":
                import torch

                torch.set_num_threads(a.threads or 1)  # as many as a Ray worker of 0.5 CPU gets
            engine = BareEngine(system_args(a, "colocated"))
            report["startup_s"]["engine"] = engine.build_s
            run = lambda batch, load: _sync(engine.run(batch, load, a.output_tokens, a.request_timeout_s))
            try:
                asyncio.run(run_series(a, report, "engine", run))
                if a.decode_batch:
                    decode = engine.decode_only(a.decode_batch, min(a.prompt_lens), a.decode_steps)
                    print(f"[engine] decode-only: {decode}", flush=True)
                    report["engine_decode_only"] = decode
            finally:
                engine.close()  # before the pipelines start
        except Exception as exc:
            fail(report, "engine", f"failed: {describe(exc)}")
    for system in [s for s in SYSTEMS[1:] if s in a.systems]:
        for backend in a.backends if system != "colocated" else [a.backends[0]]:
            name = SERIES[system] + (f"-{backend}" if len(a.backends) > 1 and system != "colocated" else "")
            args = system_args(a, system, backend)
            if "python" in a.transports:
                from moriio_ray import PDPipeline

                try:
                    start_ray(a)
                    t0 = time.perf_counter()
                    pipe = PDPipeline.launch(args)
                    report["startup_s"][f"{name}/python"] = time.perf_counter() - t0
                except Exception as exc:
                    fail(report, f"{name}/python", f"launch failed: {describe(exc)}")
                else:
                    try:
                        workers = cpu_account.worker_pids(pipe.stats())
                        series = f"{name}/python"
                        asyncio.run(run_series(a, report, series, python_cell(pipe, a), workers))
                    finally:
                        pipe.shutdown()
            for mode in a.serve_modes if "http" in a.transports else []:
                series = f"{name}/http" + ("-fast" if mode == "fast" else "")
                try:
                    t0 = time.perf_counter()
                    with ServeProcess(serve_file(a, args, mode, work)) as server:
                        report["startup_s"][series] = time.perf_counter() - t0
                        workers = cpu_account.worker_pids(server.get("/stats")[1])
                        asyncio.run(run_series(a, report, series, http_cell(server.base_url, a), workers))
                except Exception as exc:
                    fail(report, series, f"serve run failed: {describe(exc)}")


async def _sync(records: list[Record]) -> tuple[list[Record], dict[str, Any]]:
    return records, {}


def main() -> None:
    p = parser()
    a = p.parse_args()
    if a.device == "auto":
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    defaults(a, p)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still runs the clean-up below
    kind = {"random": "serving", "shared-prefix": "prefix", "n-choices": "n_choices"}[a.workload]
    report = run_record(f"serving --workload {a.workload}", vars(a), a.commit)
    report |= {
        "workload": a.workload,
        "cells": [],
        "profiles": {},
        "startup_s": {},
        "raw_columns": RAW_COLUMNS,
    }
    report["grid"] = {"concurrency": a.concurrency, "rates": a.rates, "prompt_lens": a.prompt_lens}
    report["grid"]["output_tokens"] = a.output_tokens
    stem = a.out / f"{kind}_{a.tag}"
    a.checkpoint = stem.with_suffix(".json")  # rewritten after every cell: a killed run keeps its cells
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="msb") as tmp:
            from bench.serving_workloads import n_choices, shared_prefix  # (they build on this module)

            run = {"random": random_workload, "shared-prefix": shared_prefix, "n-choices": n_choices}[
                a.workload
            ]
            run(a, report, Path(tmp))
    finally:
        report["elapsed_s"] = time.perf_counter() - t0
        with contextlib.suppress(ImportError):
            import ray

            ray.shutdown()
        write_json(stem.with_suffix(".json"), report)
        rep.render(report, stem)


if __name__ == "__main__":
    main()
