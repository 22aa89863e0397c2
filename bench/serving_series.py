"""Each system of the serving benchmark as one or two series of cells: its start-up, its cells
through ``run_series``, and its shut-down, also when something fails."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from bench.serving_client import run_http_cell
from bench.serving_run import Run, run_series
from bench.serving_stats import Record, describe
from bench.serving_systems import (
    PIPELINES,
    BareEngine,
    InprocServe,
    ProcessServe,
    PythonPipeline,
    with_stream_interval,
)
from moriio_ray import parse_pipeline_config

Cell = tuple[list[Record], dict[str, Any]]


def _quietly(fn: Any, what: str) -> None:
    """Run a clean-up step; print (do not raise) its failure, so that the next clean-up still runs."""
    try:
        fn()
    except Exception as exc:
        print(f"clean-up failed: {what}: {describe(exc)}", flush=True)


def _deadline(soft: float | None) -> float | None:
    return None if soft is None else time.perf_counter() + soft


def engine_series(run: Run) -> None:
    """The bare engine (the colocated pipeline's model and engine config) and its decode-only rate."""
    a = run.a
    config = parse_pipeline_config(run.configs["colocated"])
    if run.device == "cpu":
        import torch

        # as many threads as a Ray worker of the colocated role gets (OMP_NUM_THREADS = its num_cpus)
        torch.set_num_threads(a.threads or max(1, int(config.pool.colocated.num_cpus)))
        run.report["engine_cpu_threads"] = torch.get_num_threads()
    print(f"[engine] building ({config.model.preset}, {config.engine.device}) ...", flush=True)
    engine = BareEngine(config)
    run.done.add("engine")
    run.vocab_size = engine.vocab_size
    run.startup["engine"] = run.report["startup_s"]["engine_build"] = engine.build_s
    print(f"[engine] built in {engine.build_s:.1f} s", flush=True)

    async def cell(prompts: list[list[int]], c: int, soft: float | None) -> Cell:
        records = engine.run_cell(
            prompts, a.output_tokens, c, soft_deadline_s=_deadline(soft), timeout_s=a.request_timeout_s
        )
        return records, {}

    try:
        asyncio.run(run_series(run, "engine", "python", cell))
        print(f"[engine] decode-only at batch {a.decode_batch} ...", flush=True)
        try:
            decode = engine.decode_only(a.decode_batch, min(a.prompt_lens), a.decode_steps, a.decode_repeats)
        except Exception as exc:
            decode = {"batch": a.decode_batch, "decode_tok_s": None, "error": describe(exc)}
        run.report["engine_decode_only"] = decode
        print(
            f"[engine] decode-only: {decode['decode_tok_s'] or 0:,.0f} tok/s {decode.get('error', '')}",
            flush=True,
        )
    finally:
        run.report["engine_reserved_bytes_after_close"] = engine.close()  # before the pipelines start


def python_series(run: Run, pipe: PythonPipeline, system: str) -> None:
    a = run.a

    async def cell(prompts: list[list[int]], c: int, soft: float | None) -> Cell:
        records = await pipe.run_cell(
            prompts, a.output_tokens, c, soft_deadline_s=_deadline(soft), timeout_s=a.request_timeout_s
        )
        return records, {}

    asyncio.run(run_series(run, system, "python", cell))  # one event loop for the whole series


def http_series(run: Run, base_url: str, system: str, label: str) -> None:
    a = run.a
    url = base_url + "/v1/completions"
    fields = {
        "max_tokens": a.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},  # the client checks usage against the tokens
        "ignore_eos": True,
        "temperature": 0,
        "logprobs": 0,
    }

    async def cell(prompts: list[list[int]], c: int, soft: float | None) -> Cell:
        bodies = [{"prompt": p, **fields} for p in prompts]
        records, client = await run_http_cell(
            url, bodies, c, num_procs=a.client_procs, soft_deadline_s=soft, timeout_s=a.request_timeout_s
        )
        stats = {"procs": client.num_procs, "cpu_s": client.cpu_s, "wall_s": client.wall_s}
        return records, {"client": {**stats, "max_utilization": client.max_utilization}}

    asyncio.run(run_series(run, system, label, cell))


def served_http_series(run: Run, system: str, label: str, start: Callable[[], Any]) -> None:
    """One HTTP series: ``start()`` brings a front end up (``base_url``, ``start_s``, ``stop``), the
    cells run through it, and it is stopped, also when something fails."""
    try:
        server = start()
    except Exception as exc:
        run.fail_series(system, label, f"the front end did not start: {describe(exc)}")
        return
    try:
        run.startup["deploy"] = run.report["startup_s"][f"{system}.{label}.{server.kind}"] = server.start_s
        print(f"[{system}/{label}] {server.kind} front end up in {server.start_s:.1f} s", flush=True)
        http_series(run, server.base_url, system, label)
    except Exception as exc:
        run.fail_series(system, label, f"HTTP series failed: {describe(exc)}")
    finally:
        _quietly(server.stop, f"stopping the front end of {system}/{label}")


def pipeline_series(run: Run, system: str, work_dir: Path) -> None:
    """One pipeline: launch it, its Python-API cells, its HTTP series (in-cluster Serve), shut it down."""
    a, args = run.a, run.configs[system]
    transports = (["python"] if "python" in a.transports else []) + [h[0] for h in run.http]
    if not run.can_start("launch"):
        run.done.add(system)
        for transport in transports:
            run.fail_series(system, transport, "skipped: no time left in the budget to launch it")
        return
    print(f"[{system}] launching ...", flush=True)
    try:
        pipe = PythonPipeline(args, a.start_timeout_s)
    except Exception as exc:
        for transport in transports:
            run.fail_series(system, transport, f"launch failed: {describe(exc)}")
        return
    finally:
        run.done.add(system)
    run.startup["launch"] = run.report["startup_s"][f"{system}.launch"] = pipe.launch_s
    print(f"[{system}] launched in {pipe.launch_s:.1f} s", flush=True)
    try:
        if "python" in a.transports:
            try:
                python_series(run, pipe, system)
            except Exception as exc:
                run.fail_series(system, "python", f"series failed: {describe(exc)}")
        quiet = not a.ray_logs
        for label, mode, interval in run.http if a.http_server == "inproc" else []:
            if not run.can_start("deploy"):
                run.fail_series(system, label, "skipped: no time left in the budget to deploy it")
                continue
            args = with_stream_interval(run.configs[system], interval)
            start = partial(InprocServe, args, mode, work_dir, start_timeout_s=a.start_timeout_s, quiet=quiet)
            served_http_series(run, system, label, start)
    finally:
        _quietly(pipe.shutdown, f"shutdown of {system}")


def process_series(run: Run, system: str, work_dir: Path, base_doc: dict[str, Any]) -> None:
    """One pipeline's HTTP series through the real ``serve run`` (its own Ray cluster), per mode."""
    for label, mode, interval in run.http:
        args = with_stream_interval(run.configs[system], interval)
        print(f"[{system}/{label}] serve run ({mode}, own Ray cluster) ...", flush=True)
        served_http_series(run, system, label, partial(ProcessServe, base_doc, args, work_dir, mode))


def all_pipelines(run: Run, work_dir: Path, base_doc: dict[str, Any]) -> None:
    """Every pipeline system, one at a time, in this driver's Ray cluster (stopped at the end)."""
    import ray

    a = run.a
    t0 = time.perf_counter()
    ray.init(namespace="moriio_ray", include_dashboard=False, log_to_driver=a.ray_logs)
    run.report["startup_s"]["ray_init"] = time.perf_counter() - t0
    try:
        run.startup["ray"] = time.perf_counter() - t0
        run.done.add("ray")
        for system in (s for s in PIPELINES if s in a.systems):
            if "python" in a.transports or a.http_server == "inproc":  # else only `serve run` needs it
                pipeline_series(run, system, work_dir)
            if run.http and a.http_server == "process":
                process_series(run, system, work_dir, base_doc)
    finally:
        ray.shutdown()


def probe_serve_process(args: dict[str, Any], work_dir: Path, base_doc: dict[str, Any]) -> float | str:
    """Seconds from starting ``serve run`` on ``args`` to its first healthy answer (or why it failed)."""
    print(f"[probe] timing one `serve run` start-up of {args['name']} ...", flush=True)
    try:
        server = ProcessServe(base_doc, args, work_dir)
    except Exception as exc:
        return f"failed: {describe(exc)}"[:500]
    _quietly(server.stop, "the probe's serve run")
    print(f"[probe] serve run healthy in {server.start_s:.1f} s", flush=True)
    return server.start_s
