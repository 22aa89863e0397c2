"""cuda_ipc on the GPU, side by side with the copy-engine ceiling, a naive copy, NIXL and Mooncake.

Two worker processes (``transfer_gpu_worker.py``): P holds a Llama-3.1-8B-like layer-major cache
(4 GiB, 32 KiB segments) on ``cuda:0``, D the same on ``cuda:0`` (``--gpus 1``) or ``cuda:1``
(``--gpus 2``); CUDA IPC between them. Cases: prompts of 128, 1k, 4k and 16k tokens from random
blocks on both sides, and one 2 GiB contiguous segment (``transfer_gpu_cases.py``). D issues the
reads, P the writes; D checks every variant's bytes against P's pattern.

Phases (``--phases``, each failure is recorded and the rest go on):
- ``sweep``: kernel launch shapes on D's reads, device time; the best one runs everywhere after.
- ``table``: every method on every case, read and write: the ceiling (one ``cudaMemcpyAsync`` of
  the same bytes between the IPC-mapped buffers), naive (one ``cudaMemcpyAsync`` per segment),
  the kernel, the copy engines (``cuMemcpyBatchAsync``, with and without the overlap hint), auto.
- ``breakdown``: where the host time of one 128-token transfer goes (``transfer_gpu_breakdown.py``).
- ``load``: decode steps of the engine while transfers run (``transfer_gpu_load.py``).
- ``--peers nixl,mooncake``: the peers on the same cases (``transfer_gpu_peers.py``).

*device* is GPU time from CUDA events after the copy's waits (host enqueue hidden behind a sleep
kernel); *host* is wall time from ``read``/``write`` to ``wait`` returning: the peers are timed that
way too. Writes ``<name>.json`` and ``<name>.png`` (``--name``) under ``--out``, and prints a table.

    python bench/transfer_gpu_bench.py --out bench/results [--gpus 2] [--peers nixl] [--quick]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: moriio_ray and bench

from bench.record_paths import repo_path
from bench.transfer_gpu_cases import LAYOUT_KW, PROMPTS, cases

SWEEP: list[dict[str, Any]] = [
    {},
    {"unroll": 8},
    {"threads": 256},
    {"threads": 1024},
    {"chunk_bytes": 32 << 10},
    {"chunk_bytes": 256 << 10},
    {"chunk_bytes": 1 << 20},
    {"dynamic": False},
    {"dynamic": False, "chunk_bytes": 0},
    {"streaming": True},
    {"unroll": 8, "chunk_bytes": 256 << 10},
    {"ctas_per_sm": 1},
    {"ctas_per_sm": 2},
    {"meta_in_host": True},  # last: a fault here (pinned memory not device-mapped) would end D's context
]
SWEEP_CASES = ("layer_major/128", "layer_major/1024", "layer_major/16384", "contiguous/2GiB")
CALL_TIMEOUT_S = 120.0  # one worker command; a stuck copy must not eat the whole run
_deadline = [float("inf")]  # monotonic time after which no new variant starts (--deadline-s)


class Proc:
    """A spawned worker and its pipe: ``call`` sends a command and returns its answer."""

    def __init__(
        self, ctx: Any, target: Any, args: tuple[Any, ...], log: Path | None, start_s: float
    ) -> None:
        self.conn, child = ctx.Pipe()
        self.broken = ""
        from bench.transfer_gpu_worker import run_logged

        self.proc = ctx.Process(target=run_logged, args=(target, log, child, *args), daemon=True)
        self.proc.start()
        self.hello = self.answer(start_s)

    def send(self, cmd: str, *args: Any) -> None:
        self.conn.send((cmd, args))

    def answer(self, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        if self.broken:
            raise RuntimeError(f"worker gave up earlier: {self.broken}")
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                self.broken = f"exited with code {self.proc.exitcode}"
                raise RuntimeError(f"worker {self.broken}")
            if time.monotonic() > deadline:  # its late answer would pair with the next command
                self.broken = f"no answer within {timeout_s} s"
                raise TimeoutError(self.broken)
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def call(self, cmd: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        self.send(cmd, *args)
        return self.answer(timeout_s)

    def close(self) -> None:
        try:
            if self.proc.is_alive() and not self.broken:
                self.call("exit", timeout_s=30)
        except Exception:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def attempt(result: dict[str, Any], key: str, fn: Any) -> Any:
    """Run one phase or variant; a failure is recorded under ``result["errors"][key]``."""
    if time.monotonic() > _deadline[0]:
        result["errors"][key] = "skipped: past --deadline-s"
        return None
    try:
        return fn()
    except Exception as exc:
        result["errors"][key] = f"{exc!r}"[:2000]
        print(f"FAILED {key}: {exc!r}"[:600], flush=True)
        traceback.print_exc(limit=3)
        return None


def measure_checked(
    P: Proc, D: Proc, backend: str, op: str, case: str, variant: dict[str, Any], iters: int
) -> Any:
    """Poison D, time the variant on the issuing worker, then D checks the bytes it received."""
    D.call("poison")
    issuer = D if op == "read" else P
    row = issuer.call("measure", backend, op, case, variant, iters)
    row["verified"] = D.call("verify", case)
    if not row["verified"]:
        raise RuntimeError(f"{backend} {op} {case} {variant}: wrong bytes on D")
    return row


def run_sweep(P: Proc, D: Proc, iters: int, result: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for kv in SWEEP:
        variant = {"method": "kernel", "kernel": kv}
        for case in SWEEP_CASES:
            row = attempt(
                result,
                f"sweep/{kv}/{case}",
                lambda v=variant, c=case: measure_checked(P, D, "cuda_ipc", "read", c, v, iters),
            )
            if row is not None:
                nbytes = cases()[case].num_bytes
                rows.append({"kernel": kv, "case": case, **row, "gbps": nbytes / row["device_us"] / 1e3})
    best_per_case = {c: max((r["gbps"] for r in rows if r["case"] == c), default=0.0) for c in SWEEP_CASES}
    scores: dict[str, list[float]] = {}
    for r in rows:
        scores.setdefault(json.dumps(r["kernel"], sort_keys=True), []).append(
            r["gbps"] / best_per_case[r["case"]]
        )
    complete = {k: sum(v) / len(v) for k, v in scores.items() if len(v) == len(SWEEP_CASES)}
    best = json.loads(max(complete, key=complete.__getitem__)) if complete else {}
    score = complete.get(json.dumps(best, sort_keys=True))
    print(f"kernel variant chosen by the sweep (--variant '{json.dumps(best)}'), score {score}", flush=True)
    return {"rows": rows, "scores": complete, "best": best}


def table_variants(best: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {
        "ceiling": {"method": "memcpy", "ceiling": True},
        "naive": {"method": "memcpy"},
        "kernel": {"method": "kernel", "kernel": best},
        "copy_engine": {"method": "copy_engine"},
        "copy_engine_overlap": {"method": "copy_engine", "prefer_overlap": True},
        "auto": {"method": "auto", "kernel": best},
    }
    if best:
        out["kernel_default"] = {"method": "kernel", "kernel": {}}
    return out


def run_table(
    P: Proc, D: Proc, best: dict[str, Any], iters: int, result: dict[str, Any], methods: set[str]
) -> list[dict[str, Any]]:
    rows = []
    variants = {k: v for k, v in table_variants(best).items() if not methods or k in methods}
    for name, c in cases().items():
        for op in ("read", "write"):
            for label, variant in variants.items():
                case = f"{name}/contiguous" if variant.get("ceiling") else name
                row = attempt(
                    result,
                    f"table/{name}/{op}/{label}",
                    lambda v=variant, k=case, o=op: measure_checked(P, D, "cuda_ipc", o, k, v, iters),
                )
                if row is not None:
                    rows.append(
                        {
                            "case": name,
                            "op": op,
                            "variant": label,
                            "bytes": c.num_bytes,
                            "segments": c.num_segments,
                            **row,
                        }
                    )
                    times = f"host {row['host_us']:>10} us  device {row['device_us']} us"
                    print(f"{name:>18} {op:5} {label:>20}: {times}  ({row['method']})", flush=True)
    return rows


def run_peers(P: Proc, D: Proc, peers: list[str], iters: int, result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for peer in peers:
        descs = attempt(
            result, f"peers/{peer}/setup", lambda p=peer: (P.call("add_backend", p), D.call("add_backend", p))
        )
        if descs is None:
            continue
        if (
            attempt(
                result,
                f"peers/{peer}/connect",
                lambda p=peer, d=descs: (
                    P.call("connect_backend", p, d[1]),
                    D.call("connect_backend", p, d[0]),
                ),
            )
            is None
        ):
            continue
        modes = ("create", "repost") if peer == "nixl" else ("arrays",)
        for name, c in cases().items():
            for op in ("read", "write"):
                for mode in modes:
                    row = attempt(
                        result,
                        f"peers/{peer}/{name}/{op}/{mode}",
                        lambda p=peer, n=name, o=op, m=mode: measure_checked(
                            P, D, p, o, n, {"mode": m}, iters
                        ),
                    )
                    if row is not None:
                        rows.append(
                            {
                                "peer": peer,
                                "mode": mode,
                                "case": name,
                                "op": op,
                                "bytes": c.num_bytes,
                                "segments": c.num_segments,
                                **row,
                            }
                        )
                        print(f"{peer:>9} {mode:7} {name:>18} {op:5}: host {row['host_us']} us", flush=True)
        for role, proc in (("D", D), ("P", P)):
            info = attempt(
                result, f"peers/{peer}/info/{role}", lambda pr=proc, p=peer: pr.call("backend_info", p)
            )
            result.setdefault("peer_info", {}).setdefault(peer, {})[role] = info
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument(
        "--gpus", type=int, choices=(1, 2), default=1, help="1: P and D on cuda:0; 2: D on cuda:1"
    )
    ap.add_argument("--phases", default="sweep,table,breakdown,load")
    ap.add_argument("--peers", default="", help="comma list: nixl, mooncake")
    ap.add_argument(
        "--variant", default="", help="JSON kernel variant to use instead of a sweep, e.g. '{\"unroll\": 8}'"
    )
    ap.add_argument(
        "--methods", default="", help="table rows to run (default all): " + ",".join(table_variants({"x": 1}))
    )
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--deadline-s", type=float, default=480.0, help="start no new variant after this")
    ap.add_argument("--commit", default="", help="the commit measured (default: git rev-parse)")
    ap.add_argument("--name", default="transfer_gpu", help="stem of the JSON and PNG written under --out")
    args = ap.parse_args()
    _deadline[0] = time.monotonic() + args.deadline_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    phases = set(filter(None, args.phases.split(",")))
    peers = [p for p in args.peers.split(",") if p]
    iters = 8 if args.quick else 20
    result: dict[str, Any] = {
        "args": {**vars(args), "out": repo_path(out)},
        "layout": LAYOUT_KW,
        "prompts": PROMPTS,
        "errors": {},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    result["commit"] = args.commit or _git_commit()
    from bench.transfer_gpu_peers import set_env

    result["peer_env"] = set_env(peers)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    from bench import transfer_gpu_worker as worker

    p_dev, d_dev = 0, (1 if args.gpus == 2 else 0)
    procs: list[Proc] = []
    t0 = time.perf_counter()
    try:
        P = Proc(ctx, worker.main, ("P", p_dev, stop), out / "worker-P.log", 300)
        procs.append(P)
        D = Proc(ctx, worker.main, ("D", d_dev, stop), out / "worker-D.log", 300)
        procs.append(D)
        result["gpu"] = D.hello
        descs = P.call("add_backend", "cuda_ipc"), D.call("add_backend", "cuda_ipc")
        P.call("connect_backend", "cuda_ipc", descs[1])
        D.call("connect_backend", "cuda_ipc", descs[0])
        result["env"] = D.call("environment")
        best: dict[str, Any] = json.loads(args.variant) if args.variant else {}
        if "sweep" in phases and not args.variant:
            sweep = attempt(result, "sweep", lambda: run_sweep(P, D, iters, result))
            if sweep is not None:
                result["sweep"] = sweep
                best = sweep["best"]
        result["kernel_variant"] = best
        if "table" in phases:
            methods = set(filter(None, args.methods.split(",")))
            result["table"] = attempt(result, "table", lambda: run_table(P, D, best, iters, result, methods))
        if "breakdown" in phases:
            variant = {"method": "kernel", "kernel": best}
            result["breakdown"] = attempt(
                result, "breakdown", lambda: D.call("breakdown", "layer_major/128", variant)
            )
        result["cuda_ipc_info"] = {
            role: attempt(result, f"info/{role}", lambda pr=pr: pr.call("backend_info", "cuda_ipc"))
            for role, pr in (("D", D), ("P", P))
        }
        if peers:
            result["peers"] = run_peers(P, D, peers, iters, result)
        if "load" in phases:
            result["load"] = attempt(
                result, "load", lambda: run_load_phase(ctx, D, stop, d_dev, best, out, procs)
            )
    finally:
        for proc in reversed(procs):
            proc.close()
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        for role in ("P", "D"):
            from bench.transfer_gpu_peers import transports

            result.setdefault("transport_log_lines", {})[role] = transports(out / f"worker-{role}.log")
        write_outputs(result, out, args.name)


def run_load_phase(
    ctx: Any, D: Proc, stop: Any, device: int, best: dict[str, Any], out: Path, procs: list[Proc]
) -> Any:
    from bench.transfer_gpu_load import engine_main, run_load

    engine = Proc(ctx, engine_main, (device,), out / "engine.log", 300)
    procs.append(engine)
    variants: dict[str, dict[str, Any]] = {
        "kernel": {"method": "kernel", "kernel": best},
        "kernel_1_cta_per_sm": {"method": "kernel", "kernel": {**best, "ctas_per_sm": 1}},
        "kernel_16_ctas": {"method": "kernel", "kernel": best, "max_ctas": 16},
        "copy_engine": {"method": "copy_engine"},
        "copy_engine_overlap": {"method": "copy_engine", "prefer_overlap": True},
    }
    return run_load(engine, D, stop, "layer_major/4096", variants)


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except Exception:
        return "unknown"


def write_outputs(result: dict[str, Any], out: Path, name: str) -> None:
    from bench.transfer_gpu_report import plot, print_table, summarize

    attempt(result, "summary", lambda: summarize(result))
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    attempt(result, "plot", lambda: plot(result, out / f"{name}.png"))
    print_table(result)
    if result["errors"]:
        print("errors:", json.dumps(result["errors"], indent=1)[:6000])


if __name__ == "__main__":
    main()
