"""cuda_ipc on the GPU, side by side with the copy-engine ceiling, a naive copy, NIXL and Mooncake.

Two worker processes (``transfer_gpu_worker.py``): P and D each hold a Llama-3.1-8B-like layer-major
cache (4 GiB, 32 KiB segments), on ``cuda:0`` both (``--gpus 1``) or D on ``cuda:1`` (``--gpus 2``);
CUDA IPC between them. D issues the reads, P the writes; D checks every variant's bytes.

Phases (``--phases``; a failure is recorded and the rest go on):
- ``sweep``: kernel launch shapes on D's reads, device time; the best one runs everywhere after;
- ``table``: every method on every case, read and write: the ceiling (one ``cudaMemcpyAsync`` of the
  same bytes), naive (one per segment), the kernel, the copy engines (with and without the overlap
  hint), auto; ``--peers nixl,mooncake``: the peers on the same cases;
- ``breakdown``: where the host time of one 128-token transfer goes;
- ``load``: the decode steps of an engine (another process, same GPU) while transfers run back to
  back, against the same steps with none before and after.
*device* is GPU time from CUDA events (host enqueue hidden behind a sleep kernel); *host* is wall
time from ``read``/``write`` to ``wait`` returning, as the peers are timed. Goals: bench/goals.json.

    python bench/transfer_gpu_bench.py --out bench/results [--gpus 2] [--peers nixl] [--quick]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: moriio_ray and bench

from bench import transfer_gpu_worker as worker
from bench.common import RESULTS, median, run_record, write_json
from bench.transfer_gpu_cases import LAYOUT_KW, PROMPTS, cases
from bench.transfer_gpu_report import plot, print_table, summarize

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
LOAD_STEPS = 40
_deadline = [float("inf")]  # monotonic time after which no new variant starts (--deadline-s)


class Proc:
    """A spawned worker and its pipe: ``call`` sends a command and returns its answer."""

    def __init__(self, ctx: Any, target: Any, args: tuple[Any, ...], log: Path | None) -> None:
        self.conn, child = ctx.Pipe()
        self.broken = ""
        self.proc = ctx.Process(target=worker.run_logged, args=(target, log, child, *args), daemon=True)
        self.proc.start()
        self.hello = self.answer(300.0)

    def send(self, cmd: str, *args: Any) -> None:
        self.conn.send((cmd, args))

    def answer(self, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        if self.broken:
            raise RuntimeError(f"worker gave up earlier: {self.broken}")
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                self.broken = f"exited with code {self.proc.exitcode}"
            elif time.monotonic() > deadline:  # its late answer would pair with the next command
                self.broken = f"no answer within {timeout_s} s"
            if self.broken:
                raise RuntimeError(self.broken)
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


class Run:
    """The two workers, the result being filled in, and the one way of measuring a variant."""

    def __init__(self, P: Proc, D: Proc, result: dict[str, Any], iters: int) -> None:
        self.P, self.D, self.result, self.iters = P, D, result, iters

    def attempt(self, key: str, fn: Any) -> Any:
        """Run one phase or variant; a failure is recorded under ``result["errors"][key]``."""
        if time.monotonic() > _deadline[0]:
            self.result["errors"][key] = "skipped: past --deadline-s"
            return None
        try:
            return fn()
        except Exception as exc:
            self.result["errors"][key] = f"{exc!r}"[:2000]
            print(f"FAILED {key}: {exc!r}"[:600], flush=True)
            traceback.print_exc(limit=3)
            return None

    def measure(self, key: str, backend: str, op: str, name: str, v: dict[str, Any], **row: Any) -> Any:
        """Poison D, time the variant on the issuing worker, then D checks the bytes it received."""

        def run() -> dict[str, Any]:
            self.D.call("poison")
            got = (self.D if op == "read" else self.P).call("measure", backend, op, name, v, self.iters)
            if not (verified := self.D.call("verify", name)):
                raise RuntimeError(f"{backend} {op} {name} {v}: wrong bytes on D")
            return {**got, "verified": verified}

        if (got := self.attempt(key, run)) is None:
            return None
        c = cases()[name.removesuffix("/contiguous")]
        print(f"{key}: host {got['host_us']} us, device {got['device_us']} us ({got['method']})", flush=True)
        return row | {"case": c.name, "op": op, "bytes": c.num_bytes, "segments": c.num_segments, **got}

    def sweep(self) -> dict[str, Any]:
        """Each kernel launch shape on D's reads; the best has the highest mean share of each case's best."""
        rows = []
        for kv in SWEEP:
            for name in SWEEP_CASES:
                v = {"method": "kernel", "kernel": kv}
                if row := self.measure(f"sweep/{kv}/{name}", "cuda_ipc", "read", name, v, kernel=kv):
                    rows.append({**row, "gbps": row["bytes"] / row["device_us"] / 1e3})
        top = {c: max((r["gbps"] for r in rows if r["case"] == c), default=0.0) for c in SWEEP_CASES}
        scores: dict[str, list[float]] = {}
        for r in rows:
            scores.setdefault(json.dumps(r["kernel"], sort_keys=True), []).append(r["gbps"] / top[r["case"]])
        complete = {k: sum(v) / len(v) for k, v in scores.items() if len(v) == len(SWEEP_CASES)}
        best = json.loads(max(complete, key=complete.__getitem__)) if complete else {}
        print(f"kernel variant chosen by the sweep (--variant '{json.dumps(best)}'): {complete}", flush=True)
        return {"rows": rows, "scores": complete, "best": best}

    def table(self, best: dict[str, Any], methods: set[str]) -> list[dict[str, Any]]:
        rows = []
        for name in cases():
            for op in ("read", "write"):
                for label, v in table_variants(best).items():
                    k = f"{name}/contiguous" if v.get("ceiling") else name
                    if not methods or label in methods:
                        rows.append(
                            self.measure(f"table/{name}/{op}/{label}", "cuda_ipc", op, k, v, variant=label)
                        )
        return [r for r in rows if r]

    def peers(self, names: list[str]) -> list[dict[str, Any]]:
        rows, P, D = [], self.P, self.D
        for peer in names:
            descs = self.attempt(
                f"peers/{peer}/setup", lambda p=peer: (P.call("add_backend", p), D.call("add_backend", p))
            )
            connect = lambda p=peer, d=descs: (
                P.call("connect_backend", p, d[1]),
                D.call("connect_backend", p, d[0]),
            )
            if descs is None or self.attempt(f"peers/{peer}/connect", connect) is None:
                continue
            for name in cases():
                for op in ("read", "write"):
                    for mode in ("create", "repost") if peer == "nixl" else ("arrays",):
                        key = f"peers/{peer}/{name}/{op}/{mode}"
                        rows.append(self.measure(key, peer, op, name, {"mode": mode}, peer=peer, mode=mode))
            info = {
                r: self.attempt(f"peers/{peer}/info/{r}", lambda x=x, p=peer: x.call("backend_info", p))
                for r, x in (("D", D), ("P", P))
            }
            self.result.setdefault("peer_info", {})[peer] = info
        return [r for r in rows if r]


def table_variants(best: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {
        "ceiling": {"method": "memcpy", "ceiling": True},
        "naive": {"method": "memcpy"},
    }
    out |= {"kernel": {"method": "kernel", "kernel": best}, "copy_engine": {"method": "copy_engine"}}
    out |= {"copy_engine_overlap": {"method": "copy_engine", "prefer_overlap": True}}
    out |= {"auto": {"method": "auto", "kernel": best}}
    return out | ({"kernel_default": {"method": "kernel", "kernel": {}}} if best else {})


def load(
    ctx: Any, D: Proc, stop: Any, device: int, best: dict[str, Any], out: Path, procs: list[Proc]
) -> Any:
    """Decode steps while D pulls a 4k-token prompt's KV back to back, per transfer method; the same
    steps with no transfer before and after each method are the baseline (their mean: drift cancels)."""
    engine = Proc(ctx, worker.engine_main, (device,), out / "engine.log")
    procs.append(engine)
    variants: dict[str, dict[str, Any]] = {
        "kernel": {"method": "kernel", "kernel": best},
        "kernel_1_cta_per_sm": {"method": "kernel", "kernel": {**best, "ctas_per_sm": 1}},
        "kernel_16_ctas": {"method": "kernel", "kernel": best, "max_ctas": 16},
        "copy_engine": {"method": "copy_engine"},
        "copy_engine_overlap": {"method": "copy_engine", "prefer_overlap": True},
    }
    rows, name, idle_before = [], "layer_major/4096", engine.call("steps", LOAD_STEPS)
    for label, variant in variants.items():
        row: dict[str, Any] = {"variant": label, **variant}
        looping = False
        try:
            alone = D.call("measure", "cuda_ipc", "read", name, variant, 10)
            row |= {"transfer_alone_us": alone["host_us"], "method": alone["method"]}
            stop.clear()
            D.send("loop", "cuda_ipc", "read", name, variant)
            looping = D.answer(120) == "started"  # the first transfer ran
            loaded = engine.call("steps", LOAD_STEPS)
            stop.set()
            looping, looped = False, D.answer(120)
            idle_after = engine.call("steps", LOAD_STEPS)
            base = (median(idle_before) + median(idle_after)) / 2
            row |= {
                "step_ms_idle": round(base * 1e3, 3),
                "step_ms_loaded": round(median(loaded) * 1e3, 3),
                "decode_slowdown": round(median(loaded) / base - 1, 4),
                "transfers_during": looped["transfers"],
                "transfer_loaded_us": looped["transfer_us"],
            }
            if row["transfer_alone_us"] and row["transfer_loaded_us"]:
                row["transfer_slowdown"] = round(row["transfer_loaded_us"] / row["transfer_alone_us"] - 1, 4)
            idle_before = idle_after
        except Exception as exc:
            stop.set()
            row["error"] = repr(exc)[:500]
            if looping:  # the worker still owes the loop's answer: take it, so the pipe stays in step
                try:
                    D.answer(120)
                except Exception as late:
                    row["error"] += f"; then {late!r}"[:300]
        rows.append(row)
        print(f"  load {label:>24}: {row}", flush=True)
    return {"case": name, "batch": worker.LOAD_BATCH, "steps": LOAD_STEPS, "rows": rows}


# -- the summary, the goals and the plot ------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--gpus", type=int, choices=(1, 2), default=1, help="2: D on cuda:1")
    ap.add_argument("--phases", default="sweep,table,breakdown,load")
    ap.add_argument("--peers", default="", help="comma list: nixl, mooncake")
    ap.add_argument("--variant", default="", help="a JSON kernel variant instead of a sweep")
    ap.add_argument(
        "--methods", default="", help="table rows (default all): " + ",".join(table_variants({"x": 1}))
    )
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--deadline-s", type=float, default=480.0, help="start no new variant after this")
    ap.add_argument("--commit", default="", help="the commit measured (default: git describe)")
    ap.add_argument("--name", default="transfer_gpu", help="stem of the JSON and PNG written under --out")
    return ap


def main() -> None:
    args = parser().parse_args()
    _deadline[0] = time.monotonic() + args.deadline_s
    out, phases = args.out, set(filter(None, args.phases.split(",")))
    out.mkdir(parents=True, exist_ok=True)
    names, iters = [p for p in args.peers.split(",") if p], 8 if args.quick else 20
    result: dict[str, Any] = run_record("transfer_gpu_bench", vars(args), args.commit or None)
    result |= {"layout": LAYOUT_KW, "prompts": PROMPTS, "errors": {}, "started": time.strftime("%F %T")}
    from bench.transfer_gpu_peers import set_env, transports

    result["peer_env"] = set_env(names)
    ctx = mp.get_context("spawn")
    stop, procs, t0 = ctx.Event(), list[Proc](), time.perf_counter()
    d_dev = 1 if args.gpus == 2 else 0
    try:
        procs.append(P := Proc(ctx, worker.main, ("P", 0, stop), out / "worker-P.log"))
        procs.append(D := Proc(ctx, worker.main, ("D", d_dev, stop), out / "worker-D.log"))
        run, result["gpu"] = Run(P, D, result, iters), D.hello
        descs = P.call("add_backend", "cuda_ipc"), D.call("add_backend", "cuda_ipc")
        P.call("connect_backend", "cuda_ipc", descs[1])
        D.call("connect_backend", "cuda_ipc", descs[0])
        result["env"] = D.call("environment")
        best: dict[str, Any] = json.loads(args.variant) if args.variant else {}
        if "sweep" in phases and not args.variant and (found := run.attempt("sweep", run.sweep)) is not None:
            result["sweep"], best = found, found["best"]
        result["kernel_variant"] = best
        if "table" in phases:
            result["table"] = run.table(best, set(filter(None, args.methods.split(","))))
        if "breakdown" in phases:
            variant = {"method": "kernel", "kernel": best}
            result["breakdown"] = run.attempt(
                "breakdown", lambda: D.call("breakdown", "layer_major/128", variant)
            )
        info = lambda pr: lambda: pr.call("backend_info", "cuda_ipc")
        result["cuda_ipc_info"] = {
            role: run.attempt(f"info/{role}", info(pr)) for role, pr in (("D", D), ("P", P))
        }
        result["peers"] = run.peers(names)
        if "load" in phases:
            result["load"] = run.attempt("load", lambda: load(ctx, D, stop, d_dev, best, out, procs))
    finally:
        for proc in reversed(procs):
            proc.close()
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        result["transport_log_lines"] = {role: transports(out / f"worker-{role}.log") for role in ("P", "D")}
        for key, fn in (
            ("summary", lambda: summarize(result)),
            ("plot", lambda: plot(result, out / f"{args.name}.png")),
        ):
            try:
                fn()
            except Exception as exc:
                result["errors"][key] = repr(exc)
        write_json(out / f"{args.name}.json", result)
        print_table(result)
        if result["errors"]:
            print("errors:", json.dumps(result["errors"], indent=1)[:6000])


if __name__ == "__main__":
    main()
