"""The systems that bench/serving_bench.py drives, each one closed-loop cell at a time.

- ``BareEngine``: ``moriio_ray.engine.engine.Engine`` in this process, stepped by the benchmark;
- ``PythonPipeline``: a pipeline through ``PDPipeline.launch`` and ``pipe.stream``;
- ``InprocServe`` / ``ProcessServe``: the same pipeline behind the OpenAI front end over HTTP.

``pipeline_args`` derives every system's pipeline config from one Serve config file, so the
bare engine and every pipeline run the same model and engine settings.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import yaml

from bench.serving_client import closed_loop
from bench.serving_stats import Record
from moriio_ray import PipelineConfig, SamplingParams, parse_pipeline_config

T = TypeVar("T")
PIPELINES = ("colocated", "pd-read", "pd-write")
SYSTEMS = ("engine", *PIPELINES)
TRANSPORTS = ("python", "http")
APP_NAME = "serving-bench"


def with_stream_interval(args: dict[str, Any], interval: int | None) -> dict[str, Any]:
    """``args`` with ``serve.stream_interval`` set (unchanged for None)."""
    if interval is None:
        return args
    out = copy.deepcopy(args)
    out.setdefault("serve", {})["stream_interval"] = interval
    return out


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def pipeline_args(
    base: dict[str, Any],
    system: str,
    *,
    gpu: bool,
    max_concurrency: int,
    max_prompt_len: int,
    output_tokens: int,
    ingress_replicas: int = 1,
) -> dict[str, Any]:
    """The pipeline config (a Serve app's ``args:``) of ``system``, derived from ``base``.

    Every engine gets room for ``max_concurrency`` requests of the longest prompt at once (a fixed
    ``num_blocks``, so two engines and the bare engine fit one GPU whatever starts first).
    """
    if system not in PIPELINES:
        raise ValueError(f"system: {system!r} is not one of {', '.join(PIPELINES)}")
    args = copy.deepcopy(base)
    engine = args.setdefault("engine", {})
    block_size = int(engine.get("block_size", 16))
    max_len = max_prompt_len + output_tokens + block_size
    args["name"] = f"serving-bench-{system}"
    args.setdefault("model", {})["max_model_len"] = max_len
    engine.update(
        device="cuda" if gpu else "cpu",
        num_blocks=max_concurrency * blocks_for(max_len, block_size) + 16,
        max_num_seqs=max_concurrency,
        max_num_batched_tokens=max(int(engine.get("max_num_batched_tokens", 4096)), max_prompt_len),
    )
    transfer = args.setdefault("transfer", {})
    transfer["backend"] = "cuda_ipc" if gpu else "shm"
    transfer["mode"] = "write" if system == "pd-write" else "read"
    num_cpus = 1.0 if gpu else 0.5  # the CPU check runs on 2 shared cores
    if system == "colocated":
        one = {"replicas": 1, "num_gpus": 1.0 if gpu else 0.0, "num_cpus": num_cpus}
        pool = {"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "colocated": one}
    else:
        half = {"replicas": 1, "num_gpus": 0.5 if gpu else 0.0, "num_cpus": num_cpus}
        pool = {"prefill": dict(half), "decode": dict(half)}
    pool["placement_strategy"] = "STRICT_PACK" if gpu else "PACK"
    args["pool"] = pool
    serve = args.setdefault("serve", {})
    serve["max_ongoing_requests"] = 2 * max_concurrency  # never a 429 from the benchmark's own load
    serve["num_replicas"] = ingress_replicas  # each replica is one caller with its own streams
    parse_pipeline_config(args)  # fail before anything starts
    return args


def serve_args_of(config_path: Path) -> dict[str, Any]:
    """The ``args:`` of a Serve config file's first application (or the file, if it is a bare config)."""
    doc = yaml.safe_load(config_path.read_text())
    if isinstance(doc, dict) and "applications" in doc:
        return dict(doc["applications"][0].get("args") or {})
    return dict(doc or {})


def call_with_timeout(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """``fn()`` on a daemon thread; TimeoutError if it has not returned within ``timeout_s``."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name=what)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout_s} s")
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------------------------
# the bare engine


class BareEngine:
    """The engine of the pipelines' config, colocated, CUDA graphs on, stepped in this process."""

    def __init__(self, config: PipelineConfig) -> None:
        from moriio_ray.engine.engine import Engine

        t0 = time.perf_counter()
        self.engine: Any = Engine(config.model, config.engine, role="colocated", cuda_graphs=True)
        self.num_graphs = self.engine.capture_graphs()  # as every GPU worker does before serving
        self.build_s = time.perf_counter() - t0
        self.device = str(self.engine.device)
        self.vocab_size = int(self.engine.args.vocab_size)
        self._next_id = 0

    def _rid(self) -> str:
        self._next_id += 1
        return f"bench-{self._next_id}"

    def run_cell(
        self,
        prompts: list[list[int]],
        output_tokens: int,
        concurrency: int,
        *,
        soft_deadline_s: float | None,
        timeout_s: float,
    ) -> list[Record]:
        """Closed loop: ``concurrency`` requests in flight, a new one added when one finishes."""
        params = SamplingParams(max_tokens=output_tokens, ignore_eos=True, temperature=0.0)
        engine = self.engine
        todo = list(enumerate(prompts))[::-1]
        inflight: dict[str, Record] = {}  # in the order sent: the first is the oldest
        records: list[Record] = []
        while todo or inflight:
            now = time.perf_counter()
            if soft_deadline_s is not None and now >= soft_deadline_s:
                todo.clear()
            while todo and len(inflight) < concurrency:
                index, prompt = todo.pop()
                rid = self._rid()
                inflight[rid] = Record(index=index, sent_s=time.perf_counter(), status=200)
                engine.add_request(rid, prompt, params)
            if not inflight:
                break
            outs = engine.step()
            now = time.perf_counter()  # the step returned its tokens on the host: the device is done
            for out in outs:
                rec = inflight.get(out.request_id)
                if rec is None:
                    continue
                if out.new_token_ids:
                    rec.add_tokens(now, len(out.new_token_ids))
                if out.finished:
                    rec.done_s = now
                    records.append(inflight.pop(out.request_id))
            oldest = next(iter(inflight), None)
            if oldest is not None and now - inflight[oldest].sent_s > timeout_s:
                engine.abort(oldest)
                rec = inflight.pop(oldest)
                rec.error, rec.done_s = f"not finished within {timeout_s} s", now
                records.append(rec)
        return records

    def decode_only(self, batch: int, prompt_len: int, steps: int, repeats: int) -> dict[str, Any]:
        """Decode tok/s at a full batch (as bench/engine_bench.py measures): the median of ``repeats``.

        ``batch`` prompts are prefilled first (not timed); then only steps in which every one of
        them decodes one token are timed.
        """
        params = SamplingParams(max_tokens=steps + 2, ignore_eos=True, temperature=0.0)  # last step ends all
        runs = []
        for r in range(repeats):
            started: set[str] = set()  # requests past their prefill
            for i in range(batch):
                rid = self._rid()
                self.engine.add_request(rid, [(i * 7 + j + r) % 256 for j in range(prompt_len)], params)
            decode_s, num_tokens, num_steps = 0.0, 0, 0
            while self.engine.has_work():
                t0 = time.perf_counter()
                outs = self.engine.step()
                step_s = time.perf_counter() - t0
                ids = {o.request_id for o in outs}
                full = len(ids) == batch and ids <= started and not any(o.finished for o in outs)
                if full and num_steps < steps:
                    decode_s += step_s
                    num_tokens += sum(len(o.new_token_ids) for o in outs)
                    num_steps += 1
                started |= ids
            runs.append({"decode_s": decode_s, "tokens": num_tokens, "steps": num_steps})
        rates = [r["tokens"] / r["decode_s"] for r in runs if r["decode_s"] > 0]
        steps_ms = [1e3 * r["decode_s"] / r["steps"] for r in runs if r["steps"]]
        return {
            "batch": batch,
            "prompt_len": prompt_len,
            "decode_tok_s": statistics.median(rates) if rates else None,
            "step_ms": statistics.median(steps_ms) if steps_ms else None,
            "runs": runs,
        }

    def close(self) -> int:
        """Free the engine's memory, so that the pipelines' engines find the device empty; the bytes
        the caching allocator still holds afterwards (0 on the CPU)."""
        self.engine = None
        gc.collect()
        import torch

        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            return int(torch.cuda.memory_reserved())
        return 0


# ----------------------------------------------------------------------------------------------
# the pipeline through the Python API


class PythonPipeline:
    """A pipeline launched in this driver's Ray cluster; requests through ``pipe.stream``."""

    def __init__(self, args: dict[str, Any], launch_timeout_s: float) -> None:
        from moriio_ray import PDPipeline

        self.config = parse_pipeline_config(args)
        t0 = time.perf_counter()
        self.pipe: Any = call_with_timeout(
            lambda: PDPipeline.launch(self.config), launch_timeout_s, "PDPipeline.launch"
        )
        self.launch_s = time.perf_counter() - t0

    async def run_cell(
        self,
        prompts: list[list[int]],
        output_tokens: int,
        concurrency: int,
        *,
        soft_deadline_s: float | None,
        timeout_s: float,
    ) -> list[Record]:
        params = SamplingParams(max_tokens=output_tokens, ignore_eos=True, temperature=0.0)

        async def one(slot: int, item: tuple[int, list[int]]) -> Record:
            rec = Record(index=item[0], sent_s=time.perf_counter(), status=200)
            try:
                async with contextlib.aclosing(self.pipe.stream(token_ids=item[1], params=params)) as events:
                    async for event in events:
                        if event.token_ids:
                            rec.add_tokens(time.perf_counter(), len(event.token_ids))
            except Exception as exc:  # one request's failure is recorded; the cell goes on
                rec.error = f"{type(exc).__name__}: {exc}"[:300]
            rec.done_s = time.perf_counter()
            return rec

        def timed_out(slot: int, item: tuple[int, list[int]]) -> Record:
            now = time.perf_counter()
            return Record(index=item[0], sent_s=now, done_s=now, status=200, error=f"timeout {timeout_s} s")

        return await closed_loop(
            list(enumerate(prompts)),
            concurrency,
            one,
            soft_deadline_s=soft_deadline_s,
            timeout_s=timeout_s,
            on_timeout=timed_out,
        )

    def shutdown(self) -> None:
        self.pipe.shutdown()


# ----------------------------------------------------------------------------------------------
# HTTP front ends


def wait_healthy(base_url: str, timeout_s: float) -> None:
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)  # polling a server that is starting
    raise TimeoutError(f"{base_url}/health did not answer 200 within {timeout_s} s")


class InprocServe:
    """Ray Serve in the benchmark's own Ray cluster, running the app ``serve run`` would build over
    ``args``, ready when the constructor returns; its ingress attaches to the pipeline that the
    Python-API cells launched. ``mode`` (default, fast) is set where Serve's controller starts, so
    each front end is one ``serve.start`` ... ``serve.shutdown``."""

    kind = "inproc"

    def __init__(
        self, args: dict[str, Any], mode: str, work_dir: Path, *, start_timeout_s: float, quiet: bool
    ) -> None:
        from ray import serve

        from moriio_ray.serve import build_app
        from moriio_ray.serve.process import free_port
        from moriio_ray.serve.serve_mode import isolated, with_mode

        self.port = free_port()
        # beside any other HAProxy on this host: free ports, files in the run's temp dir
        doc = isolated(with_mode({}, mode), free_port, str(work_dir / f"h{self.port}"))
        http = {"host": "127.0.0.1", "port": self.port}
        t0 = time.perf_counter()
        start = partial(serve.start, http_options=http, controller_options=doc.get("controller_options"))
        call_with_timeout(start, start_timeout_s, "serve.start")
        if quiet:  # after serve.start, which sets up this logger: one line per cell
            logging.getLogger("ray.serve").setLevel(logging.WARNING)
        try:
            run = partial(serve.run, build_app(args), name=APP_NAME, route_prefix="/")
            call_with_timeout(run, start_timeout_s, "serve.run")
            wait_healthy(self.base_url, start_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Delete the app (not the pipeline, which the Python API launched), then stop Serve."""
        from ray import serve

        try:
            call_with_timeout(lambda: serve.delete(APP_NAME), 120.0, "serve.delete")
        finally:
            call_with_timeout(serve.shutdown, 120.0, "serve.shutdown")


class ProcessServe:
    """The real ``serve run`` of a config file in a child process with its own Ray cluster."""

    kind = "process"

    def __init__(
        self, base_doc: dict[str, Any], args: dict[str, Any], work_dir: Path, mode: str | None = None
    ) -> None:
        from moriio_ray.serve.process import ServeProcess
        from moriio_ray.serve.serve_mode import mode_of, with_mode

        mode = mode or mode_of(base_doc)  # None: the config file's own
        doc = with_mode(base_doc, mode)
        doc["applications"][0]["args"] = args
        path = work_dir / f"{args['name']}-{mode}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.server = ServeProcess(path)
        t0 = time.perf_counter()
        self.server.__enter__()  # start, wait for /health; cleans up after itself if that fails
        self.start_s = time.perf_counter() - t0

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def stop(self) -> None:
        self.server.__exit__(None, None, None)
