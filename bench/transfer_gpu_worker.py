"""The processes of ``transfer_gpu_bench.py``: P (holds the prefill cache) or D (the decode cache), and
the decode engine of the load phase; and the workload both workers rebuild from the same seeds.

The workload: a Llama-3.1-8B-like layer-major cache (32 layers, 8 KV heads, head dim 128, bf16,
block 16: one (layer, K or V, block) is 32 KiB); prompts of 128, 1k, 4k and 16k tokens from random
blocks on both sides, and one 2 GiB contiguous segment. Each worker owns one cache on its GPU and a
backend per library under test (``cuda_ipc`` here, the peers in ``transfer_gpu_peers.py``); it
times the transfers it issues (D the reads, P the writes). D checks results against P's pattern,
rebuilt on its own GPU. A failing command answers with its error; the worker goes on.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from bench.common import agent_op, median
from bench.transfer_gpu_cases import Case, case, fill_random, layout

P_SEED, D_SEED, POISON_SEED = 1234, 5678, 91011
HOLD_CYCLES = 1_000_000  # ~0.5 ms of GPU sleep: the host enqueues the copy meanwhile (device timing)
WAIT_S = 60.0  # one transfer's deadline
MEASURE_BUDGET_S = 1.5  # per (variant, case): stop early once this much wall time went into timing
LOAD_BATCH, LOAD_PROMPT = 64, 128  # the load phase's decode batch


class CudaIpcBackend:
    """Our agent; ``prepare`` applies a variant (method, kernel shape, copy-engine hint) first."""

    name = "cuda_ipc"

    def __init__(self, role: str, device: int, cache: torch.Tensor) -> None:
        from moriio_ray.transfer import TransferConfig, create_agent, encode_desc

        self.device = device
        self.agent: Any = create_agent(TransferConfig(backend="cuda_ipc", timeout_s=WAIT_S), f"bench-{role}")
        self.mem = self.agent.register(cache)
        self.desc = (encode_desc(self.agent.engine_desc()), encode_desc(self.mem))
        self.peer_mem: Any = None

    def connect(self, peer: Any) -> None:
        from moriio_ray.transfer import decode_engine_desc, decode_memory_desc

        self.agent.connect(decode_engine_desc(peer[0]))
        self.peer_mem = decode_memory_desc(peer[1])

    def prepare(self, op: str, c: Case, variant: dict[str, Any]) -> Callable[[], Any]:
        from moriio_ray.transfer.cuda_kernels import KernelVariant

        kv = variant.get("kernel")
        self.agent.tune(
            method=variant.get("method", "auto"),
            variant=KernelVariant(**(kv or {})),
            max_ctas=variant.get("max_ctas", 0),
            prefer_overlap=variant.get("prefer_overlap", False),
            batch=variant.get("batch", True),
        )
        local, remote = (c.d_off, c.p_off) if op == "read" else (c.p_off, c.d_off)  # D pulls, P pushes
        return lambda: agent_op(self.agent, op, self.mem, self.peer_mem, local, remote, c.sizes)

    def info(self) -> dict[str, Any]:
        mode, reason = self.agent.copy_engine_mode(self.device)
        lane = self.agent._lane(torch.device("cuda", self.device))
        return {
            "copy_engine_submission": mode,
            "copy_engine_fallback_reason": reason,
            "kernel_ctas_capacity": lane.copier.capacity,
            "num_sms": lane.copier.num_sms,
        }

    def close(self) -> None:
        self.agent.close()


def _us(xs: list[float]) -> float | None:
    return round(median(xs) * 1e6, 2) if xs else None


def _time(fn: Callable[[], Any], iters: int = 300, drain: Callable[[], Any] | None = None) -> float | None:
    """Median µs of ``fn`` (the first 5 left out); ``drain`` every 50 calls, so the GPU queue never fills."""
    out = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        if drain is not None and i % 50 == 49:
            drain()
    if drain is not None:
        drain()
    return _us(out[5:])


class Worker:
    def __init__(self, role: str, device: int) -> None:
        from moriio_ray.transfer import cuda_memory

        torch.cuda.set_device(device)
        self.role, self.device, self.backends = role, device, dict[str, Any]()
        self.cache = cuda_memory.allocate(layout().total_bytes, torch.device("cuda", device))  # exportable
        fill_random(self.cache, P_SEED if role == "P" else D_SEED)
        self.p_ref: torch.Tensor | None = None
        if role == "D":
            self.p_ref = torch.empty_like(self.cache)
            fill_random(self.p_ref, P_SEED)
        torch.cuda.synchronize()

    def add_backend(self, name: str) -> Any:
        if name == "cuda_ipc":
            self.backends[name] = CudaIpcBackend(self.role, self.device, self.cache)
        else:
            from bench.transfer_gpu_peers import make_peer_backend

            self.backends[name] = make_peer_backend(name, self.role, self.device, self.cache)
        return self.backends[name].desc

    def connect_backend(self, name: str, peer_desc: Any) -> bool:
        self.backends[name].connect(peer_desc)
        return True

    def backend_info(self, name: str) -> dict[str, Any]:
        return dict(self.backends[name].info())

    def environment(self) -> dict[str, Any]:
        import ctypes

        import cupy

        version = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
        return {
            "gpu": torch.cuda.get_device_name(self.device),
            "torch": torch.__version__,
            "cupy": cupy.__version__,
            "torch_cuda": torch.version.cuda,
            "driver_cuda_version": version.value,
            "python": sys.version.split()[0],
        }

    def poison(self) -> bool:
        fill_random(self.cache, POISON_SEED)
        torch.cuda.synchronize()
        return True

    def verify(self, name: str) -> bool:
        """Whether D's cache holds P's bytes where the case put them."""
        assert self.p_ref is not None, "only D verifies"
        torch.cuda.synchronize()
        c = case(name)
        if c.d_blocks is None or c.p_blocks is None:
            return bool(torch.equal(self.cache[: c.num_bytes], self.p_ref[: c.num_bytes]))
        d5, p5 = (t.view(torch.int16).view(layout().shape) for t in (self.cache, self.p_ref))
        d_idx, p_idx = (torch.as_tensor(b, device=self.cache.device) for b in (c.d_blocks, c.p_blocks))
        return bool(torch.equal(d5.index_select(2, d_idx), p5.index_select(2, p_idx)))  # dim 2: blocks

    def measure(
        self, backend: str, op: str, name: str, variant: dict[str, Any], iters: int
    ) -> dict[str, Any]:
        """Host (issue to wait returned) and, for cuda_ipc, device times of one variant on one case."""
        issue = self.backends[backend].prepare(op, case(name), variant)
        first = issue()
        first.wait(timeout_s=WAIT_S)
        agent = self.backends[backend].agent if backend == "cuda_ipc" else None
        device_s, host_s = list[float](), list[float]()
        if agent is not None:  # device time: CUDA events after the copy's waits, host enqueue hidden
            agent.time_transfers, start = True, time.perf_counter()
            try:
                while len(device_s) < iters and (
                    len(device_s) < 2 or time.perf_counter() - start < MEASURE_BUDGET_S
                ):
                    torch.cuda._sleep(HOLD_CYCLES)  # on the current stream, which the copy waits for
                    (x := issue()).wait(timeout_s=WAIT_S)
                    x.event.synchronize()
                    device_s.append(x.start_event.elapsed_time(x.event) * 1e-3)
            finally:
                agent.time_transfers = False
        start = time.perf_counter()
        while len(host_s) < iters and (len(host_s) < 2 or time.perf_counter() - start < MEASURE_BUDGET_S):
            t0 = time.perf_counter()
            issue().wait(timeout_s=WAIT_S)
            host_s.append(time.perf_counter() - t0)
        return {
            "method": getattr(first, "method", backend),
            "host_us": _us(host_s),
            "device_us": _us(device_s),
            "n": len(host_s),
            "host_us_min": round(min(host_s) * 1e6, 2),
        }

    def loop(
        self, backend: str, op: str, name: str, variant: dict[str, Any], *, stop: Any, conn: Connection
    ) -> Any:
        """Transfers back to back until ``stop`` is set; answers "started" after the first one."""
        issue = self.backends[backend].prepare(op, case(name), variant)
        issue().wait(timeout_s=WAIT_S)
        conn.send(("ok", "started"))
        times = []
        while not stop.is_set():
            t0 = time.perf_counter()
            issue().wait(timeout_s=WAIT_S)
            times.append(time.perf_counter() - t0)
        return {"transfers": len(times), "transfer_us": _us(times)}

    def breakdown(self, name: str, variant: dict[str, Any]) -> dict[str, Any]:
        """Where the host time of one cuda_ipc read goes: each step of the issue path timed alone."""
        from moriio_ray.transfer import cuda_driver, cuda_methods
        from moriio_ray.transfer.plan import Copy, TransferPlan

        b, c = self.backends["cuda_ipc"], case(name)
        agent, mem, peer_mem, lo, ro, sz = b.agent, b.mem, b.peer_mem, c.d_off, c.p_off, c.sizes
        issue = b.prepare("read", c, variant)
        issue().wait(timeout_s=WAIT_S)
        dev = torch.device("cuda", self.device)
        lane, pending = agent._lane(dev), list[Any]()
        sync = lane.stream.synchronize
        out: dict[str, Any] = {"case": c.name, "segments": c.num_segments, "variant": variant}
        out["end_to_end_us"] = _time(lambda: issue().wait(timeout_s=WAIT_S))

        def drain() -> None:
            sync()
            pending.clear()

        out["issue_only_us"] = _time(lambda: pending.append(issue()), drain=drain)
        waits = []
        for _ in range(100):
            x, t0 = issue(), time.perf_counter()
            x.wait(timeout_s=WAIT_S)
            waits.append(time.perf_counter() - t0)
        out["wait_after_issue_us"] = _us(waits)

        def checks() -> None:
            plan = TransferPlan(lo, ro, sz)
            plan.check_local(mem.num_bytes, "x")
            plan.check_remote(peer_mem.num_bytes, "y")

        cfg, seg = agent.config.cuda_ipc, cuda_methods.describe(sz)
        out["base_checks_us"] = _time(checks)
        out["describe_and_choose_us"] = _time(
            lambda: cuda_methods.choose(
                cfg.method,
                cuda_methods.describe(sz),
                small_transfer_bytes=cfg.small_transfer_bytes,
                copy_engine_segment_bytes=cfg.copy_engine_segment_bytes,
            )
        )
        out["peer_alive_us"] = _time(lambda: agent._peer_alive(peer_mem.engine_key, thorough=False))
        src, _ = agent._remote_region(agent.peers()[peer_mem.engine_key], peer_mem, dev.index)
        dst = agent.local_tensor(mem).data_ptr()
        with cuda_driver.ContextGuard(lane.ctx):
            out["context_guard_us"] = _time(lambda: cuda_driver.ContextGuard(lane.ctx).__enter__())

            def order() -> None:
                lane.order.record(agent._current_stream(lane.index))
                cuda_driver.stream_wait(lane.handle, lane.order)

            out["stream_order_us"] = _time(order)
            out["stage_metadata_us"] = _time(lambda: lane.copier._stage(Copy(ro, lo, sz), seg), drain=sync)
            out["stage_and_launch_us"] = _time(
                lambda: lane.copier.copy(src, dst, Copy(ro, lo, sz), seg), drain=sync
            )
            out["copy_engine_batch_submit_us"] = _time(
                lambda: lane.engine.copy(src, dst, Copy(ro, lo, sz), lane.handle), iters=60, drain=sync
            )
            out["raw_event_create_record_us"] = _time(
                lambda: cuda_driver.RawEvent().record(lane.handle), drain=sync
            )
        out["launch_us"] = round((out["stage_and_launch_us"] or 0) - (out["stage_metadata_us"] or 0), 2)
        return out


def engine_main(conn: Connection, device: int) -> None:
    """The load phase's decode process: ``llama-1b``, bf16, CUDA graphs, LOAD_BATCH sequences
    decoding; answers ``("steps", n)`` with n step times (s)."""
    try:
        from moriio_ray.config import EngineConfig, ModelConfig
        from moriio_ray.engine.engine import Engine
        from moriio_ray.engine.sampling import SamplingParams

        torch.cuda.set_device(device)
        config = EngineConfig(
            device="cuda",
            num_blocks=8192,
            max_num_seqs=LOAD_BATCH,
            max_num_batched_tokens=LOAD_BATCH * LOAD_PROMPT,
        )
        engine = Engine(
            ModelConfig(preset="llama-1b", dtype="bfloat16", max_model_len=2048),
            config,
            role="colocated",
            cuda_graphs=True,
        )
        prompts = torch.randint(0, 256, (LOAD_BATCH, LOAD_PROMPT), generator=torch.Generator().manual_seed(0))
        for i, prompt in enumerate(prompts.tolist()):
            engine.add_request(f"load-{i}", prompt, SamplingParams(max_tokens=1800, ignore_eos=True))
        for _ in range(11):  # the prefill of all of them, then a warm-up
            engine.step()
        torch.cuda.synchronize()
        conn.send(("ok", "ready"))
    except Exception as exc:
        conn.send(("error", repr(exc)))
        return
    while (msg := conn.recv())[0] != "exit":
        try:
            times, batch = [], LOAD_BATCH
            for _ in range(int(msg[1][0])):
                t0 = time.perf_counter()
                batch = min(batch, len(engine.step()))
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            if batch != LOAD_BATCH:  # the steps did not all decode the whole batch: not comparable
                raise RuntimeError(f"a decode step produced {batch} outputs, expected {LOAD_BATCH}")
            conn.send(("ok", times))
        except Exception as exc:
            conn.send(("error", repr(exc)))
    conn.send(("ok", None))


def main(conn: Connection, role: str, device: int, stop: Any) -> None:
    """The command loop: ``(command, args)`` in, ``("ok", value)`` or ``("error", text)`` out."""
    try:
        worker = Worker(role, device)
        conn.send(("ok", torch.cuda.get_device_name(device)))
    except Exception:
        conn.send(("error", traceback.format_exc(limit=8)))
        return
    while (msg := conn.recv())[0] != "exit":
        cmd, args = msg
        try:
            value = worker.loop(*args, stop=stop, conn=conn) if cmd == "loop" else getattr(worker, cmd)(*args)
            conn.send(("ok", value))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"))
    for b in worker.backends.values():
        try:
            b.close()
        except Exception:
            pass
    conn.send(("ok", None))


def run_logged(target: Any, log: Any, *args: Any) -> None:
    """Spawn target: this process's fd 1 and 2 (where C libraries log) to ``log``, then ``target``."""
    if log is not None:
        import os

        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    target(*args)
