"""A worker process of ``transfer_gpu_bench.py``: P (holds the prefill cache) or D (the decode cache).

Each worker owns one 4 GiB cache on its GPU and one backend object per library under test
(``cuda_ipc`` here, ``nixl`` and ``mooncake`` in ``transfer_gpu_peers.py``). Its command loop
(``main``) times transfers that *it* issues: D issues the reads (pulls), P the writes (pushes).
D alone checks results, against P's pattern rebuilt on its GPU. A failing command answers with
its error; the worker goes on.
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from bench.transfer_gpu_cases import D_SEED, P_SEED, POISON_SEED, Case, case, fill_random, layout, verify

HOLD_CYCLES = 1_000_000  # ~0.5 ms of GPU sleep: the host enqueues the copy meanwhile (device timing)
WAIT_S = 60.0  # one transfer's deadline
MEASURE_BUDGET_S = 1.5  # per (variant, case): stop early once this much wall time went into timing


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

    def prepare(self, op: str, c: Case, variant: dict[str, Any]) -> Any:
        from moriio_ray.transfer.cuda_kernels import KernelVariant

        kv = variant.get("kernel")
        self.agent.tune(
            method=variant.get("method", "auto"),
            variant=KernelVariant(**kv) if kv is not None else KernelVariant(),
            max_ctas=variant.get("max_ctas", 0),
            prefer_overlap=variant.get("prefer_overlap", False),
            batch=variant.get("batch", True),
        )
        if op == "read":  # D pulls: local = D
            return lambda: self.agent.read(self.mem, self.peer_mem, c.d_off, c.p_off, c.sizes)
        return lambda: self.agent.write(self.mem, self.peer_mem, c.p_off, c.d_off, c.sizes)

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


def _median_us(xs: list[float]) -> float | None:
    return round(statistics.median(xs) * 1e6, 2) if xs else None


class Worker:
    def __init__(self, role: str, device: int) -> None:
        torch.cuda.set_device(device)
        self.role, self.device = role, device
        from moriio_ray.transfer import cuda_memory

        self.cache = cuda_memory.allocate(layout().total_bytes, torch.device("cuda", device))  # exportable
        fill_random(self.cache, P_SEED if role == "P" else D_SEED)
        self.p_ref: torch.Tensor | None = None
        if role == "D":
            self.p_ref = torch.empty_like(self.cache)
            fill_random(self.p_ref, P_SEED)
        torch.cuda.synchronize()
        self.backends: dict[str, Any] = {}

    def add_backend(self, name: str) -> Any:
        if name == "cuda_ipc":
            backend: Any = CudaIpcBackend(self.role, self.device, self.cache)
        else:
            from bench.transfer_gpu_peers import make_peer_backend

            backend = make_peer_backend(name, self.role, self.device, self.cache)
        self.backends[name] = backend
        return backend.desc

    def connect_backend(self, name: str, peer_desc: Any) -> bool:
        self.backends[name].connect(peer_desc)
        return True

    def backend_info(self, name: str) -> dict[str, Any]:
        return dict(self.backends[name].info())

    def environment(self) -> dict[str, Any]:
        import ctypes

        import cupy
        import numpy

        version = ctypes.c_int()
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
        return {
            "gpu": torch.cuda.get_device_name(self.device),
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "cupy": cupy.__version__,
            "numpy": numpy.__version__,
            "driver_cuda_version": version.value,
            "python": sys.version.split()[0],
        }

    def poison(self) -> bool:
        fill_random(self.cache, POISON_SEED)
        torch.cuda.synchronize()
        return True

    def verify(self, name: str) -> bool:
        assert self.p_ref is not None, "only D verifies"
        torch.cuda.synchronize()
        return verify(self.cache, self.p_ref, case(name))

    def measure(
        self, backend: str, op: str, name: str, variant: dict[str, Any], iters: int
    ) -> dict[str, Any]:
        """Host (issue to wait returned) and, for cuda_ipc, device times of one variant on one case."""
        b = self.backends[backend]
        c = case(name)
        issue = b.prepare(op, c, variant)
        first = issue()
        first.wait(timeout_s=WAIT_S)
        out: dict[str, Any] = {"method": getattr(first, "method", backend)}
        agent = b.agent if backend == "cuda_ipc" else None
        device_s: list[float] = []
        if agent is not None:  # device time: CUDA events after the copy's waits, host enqueue hidden
            agent.time_transfers = True
            start = time.perf_counter()
            try:
                while len(device_s) < iters and (
                    len(device_s) < 2 or time.perf_counter() - start < MEASURE_BUDGET_S
                ):
                    torch.cuda._sleep(HOLD_CYCLES)  # on the current stream, which the copy waits for
                    x = issue()
                    x.wait(timeout_s=WAIT_S)
                    device_s.append(x.device_seconds())
            finally:
                agent.time_transfers = False
        host_s: list[float] = []
        start = time.perf_counter()
        while len(host_s) < iters and (len(host_s) < 2 or time.perf_counter() - start < MEASURE_BUDGET_S):
            t0 = time.perf_counter()
            issue().wait(timeout_s=WAIT_S)
            host_s.append(time.perf_counter() - t0)
        out.update(host_us=_median_us(host_s), device_us=_median_us(device_s), n=len(host_s))
        out["host_us_min"] = round(min(host_s) * 1e6, 2)
        return out

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
        return {"transfers": len(times), "transfer_us": _median_us(times)}

    def breakdown(self, name: str, variant: dict[str, Any]) -> dict[str, Any]:
        from bench.transfer_gpu_breakdown import breakdown

        return breakdown(self.backends["cuda_ipc"], case(name), variant)


def run_logged(target: Any, log: Any, *args: Any) -> None:
    """Spawn target: send this process's output to ``log`` (C libraries log there), then run ``target``."""
    if log is not None:
        from bench.transfer_gpu_peers import redirect_output

        redirect_output(log)
    target(*args)


def main(conn: Connection, role: str, device: int, stop: Any) -> None:
    """The command loop: ``(command, args)`` in, ``("ok", value)`` or ``("error", text)`` out."""
    try:
        worker = Worker(role, device)
        conn.send(("ok", torch.cuda.get_device_name(device)))
    except Exception:
        conn.send(("error", traceback.format_exc(limit=8)))
        return
    while True:
        cmd, args = conn.recv()
        if cmd == "exit":
            for b in worker.backends.values():
                try:
                    b.close()
                except Exception:
                    pass
            conn.send(("ok", None))
            return
        try:
            if cmd == "loop":
                value = worker.loop(*args, stop=stop, conn=conn)
            else:
                value = getattr(worker, cmd)(*args)
            conn.send(("ok", value))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"))
