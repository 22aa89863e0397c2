"""cuda_ipc against the NVLink ceiling, naive copies, NIXL and NCCL, on two GPUs, in one run.

Cache: Llama-3.1-8B-like (32 layers, 8 KV heads, head dim 128, bf16, block 16), 2,048 blocks (4 GiB)
per GPU, layer-major and block-major. A prompt's blocks are scattered at random on both sides and
turned into segments by ``plan_blocks``. P (the prefill cache) is on GPU 0, D (decode) on GPU 1:

- (a) ceiling: one contiguous 1 GiB ``copy_`` GPU 0 -> GPU 1 (copy engines);
- (b) naive: one ``copy_`` per segment of the plan;
- (c) cuda_ipc: D ``read`` (pull, kernel on GPU 1) and P ``write`` (push, kernel on GPU 0); both
  agents live in this process (peer pointers; across processes the same kernel runs on IPC-mapped
  memory, see tests/gpu);
- (d) NIXL push (if installed) and NCCL send/recv, from ``transfer_gpu_baselines.py``.

Device time is CUDA events on the copy stream (median after warm-up); host latency is the wall
time from ``read``/``write`` to ``wait`` returning. Every method's result is checked byte for byte.

    python bench/transfer_gpu_bench.py [--quick] [--out bench/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for moriio_ray

from transfer_gpu_baselines import blocks_equal, fill_random, run_nccl, run_nixl

from moriio_ray.config import CudaIpcConfig, TransferConfig
from moriio_ray.transfer import TransferPlan, create_agent, cuda_kernels, plan_blocks
from moriio_ray.transfer.cuda_devices import enable_peer_access
from moriio_ray.transfer.cuda_kernels import KernelVariant, SegmentCopier
from moriio_ray.transfer.layout import BLOCK_MAJOR, LAYER_MAJOR, KVLayout

LAYOUT_KW: dict[str, Any] = dict(
    num_layers=32, num_blocks=2048, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16"
)
PROMPTS = (128, 1024, 4096, 16384)
SEEDS = (1234, 5678)  # P's cache, D's cache
GB = 1e9


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def sync() -> None:
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)


HOLD_CYCLES = 400_000  # about 200 us of GPU sleep: the host enqueues the copy meanwhile


def time_device(stream: torch.cuda.Stream, issue: Any, iters: int, warmup: int = 3) -> float:
    """Median GPU seconds of ``issue()``'s copy (metadata upload + kernel), host enqueue time hidden.

    The agent must have ``time_transfers`` set. A short sleep kernel keeps ``stream`` busy while the
    host issues, so the copy's start event fires only once everything is queued.
    """
    for _ in range(warmup):
        issue().wait(timeout_s=60)
    out = []
    for _ in range(iters):
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            torch.cuda._sleep(HOLD_CYCLES)
        x = issue()
        x.wait(timeout_s=60)
        out.append(x.device_seconds())
    return median(out)


def time_host(issue: Any, iters: int) -> float:
    """Median wall seconds from issuing to ``wait`` returning."""
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        issue().wait(timeout_s=60)
        out.append(time.perf_counter() - t0)
    return median(out)


def ceiling(p: torch.Tensor, d: torch.Tensor, iters: int) -> dict[str, Any]:
    """(a): one contiguous 1 GiB copy GPU 0 -> GPU 1, and the same through our kernel (one segment)."""
    n = 1 << 30
    src, dst = p[:n], d[:n]
    out = []
    for i in range(iters + 3):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        if i >= 3:
            out.append(time.perf_counter() - t0)
    s = median(out)
    return {"bytes": n, "seconds": s, "gbps": n / s / GB}


def naive(p: torch.Tensor, d: torch.Tensor, plan: Any, iters: int) -> float:
    """(b): one ``copy_`` per segment, GPU 0 -> GPU 1; median wall seconds."""
    lo, ro, sz = plan.local_offsets.tolist(), plan.remote_offsets.tolist(), plan.sizes.tolist()
    out = []
    for i in range(iters + 1):
        sync()
        t0 = time.perf_counter()
        for a, b, n in zip(lo, ro, sz, strict=True):
            d[a : a + n].copy_(p[b : b + n])
        sync()
        if i >= 1:
            out.append(time.perf_counter() - t0)
    return median(out)


VARIANTS = [
    KernelVariant(unroll=u, ctas_per_sm=c, chunk_bytes=ch, streaming=st)
    for u in (4, 8)
    for c in (2, 4)
    for ch in (0, 64 << 10)
    for st in (False, True)
] + [KernelVariant(unroll=u, ctas_per_sm=8, threads=256) for u in (4, 8)]


def sweep(p: torch.Tensor, d: torch.Tensor, plans: dict[str, Any], iters: int) -> list[dict[str, Any]]:
    """Kernel variants on the raw launcher, pull (kernel on GPU 1) and push (kernel on GPU 0), P -> D."""
    rows = []
    for variant in VARIANTS:
        for op, dev in (("read", 1), ("write", 0)):
            stream = torch.cuda.Stream(device=dev)
            cp = SegmentCopier(torch.device("cuda", dev), stream, variant)
            for name, plan in plans.items():
                so, do = plan.remote_offsets, plan.local_offsets
                with torch.cuda.device(dev), torch.cuda.stream(stream):
                    for _ in range(3):
                        cp.copy(p.data_ptr(), d.data_ptr(), so, do, plan.sizes)
                    times = []
                    for _ in range(iters):
                        torch.cuda._sleep(HOLD_CYCLES)
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record(stream)
                        cp.copy(p.data_ptr(), d.data_ptr(), so, do, plan.sizes)
                        e.record(stream)
                        e.synchronize()
                        times.append(s.elapsed_time(e) * 1e-3)
                t = median(times)
                rows.append(
                    {
                        **dataclasses.asdict(variant),
                        "op": op,
                        "case": name,
                        "seconds": t,
                        "gbps": plan.num_bytes / t / GB,
                    }
                )
    return rows


def best_variant(rows: list[dict[str, Any]], case: str) -> KernelVariant:
    """The variant with the highest mean of read and write GB/s on ``case``."""
    fields = [f.name for f in dataclasses.fields(KernelVariant)]
    score: dict[tuple[Any, ...], list[float]] = {}
    for r in rows:
        if r["case"] == case:
            score.setdefault(tuple(r[f] for f in fields), []).append(r["gbps"])
    key = max(score, key=lambda k: sum(score[k]) / len(score[k]))
    return KernelVariant(**dict(zip(fields, key, strict=True)))


def small(agents: dict[str, Any], p_mem: Any, d_mems: dict[str, Any], iters: int) -> list[dict[str, Any]]:
    """Few 32 KiB segments: the kernel against one cudaMemcpyAsync per segment (device and host time)."""
    rows = []
    rng = np.random.default_rng(9)
    seg = 32 << 10
    for count in (1, 2, 4, 16, 64, 256):
        lo = rng.choice(4096, count, replace=False).astype(np.int64) * seg
        ro = rng.choice(4096, count, replace=False).astype(np.int64) * seg
        sz = np.full(count, seg, dtype=np.int64)
        for path, agent in agents.items():

            def issue(agent: Any = agent, path: str = path, lo: Any = lo, ro: Any = ro, sz: Any = sz) -> Any:
                return agent.read(d_mems[path], p_mem, lo, ro, sz)

            dev_s = time_device(agent.stream(1), issue, iters)
            host_s = time_host(issue, iters)
            rows.append(
                {"segments": count, "bytes": count * seg, "path": path, "device_s": dev_s, "host_s": host_s}
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--skip", default="", help="comma list of phases to skip: sweep,naive,small,nccl,nixl")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    iters = 10 if args.quick else 30
    assert torch.cuda.device_count() >= 2, "this benchmark needs two GPUs"
    enable_peer_access(0, 1)
    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "layout": LAYOUT_KW,
        "iters": iters,
        "errors": {},
    }
    cfg = TransferConfig(backend="cuda_ipc")
    P: Any = create_agent(cfg, "P")
    D: Any = create_agent(cfg, "D")
    total = KVLayout(**LAYOUT_KW).total_bytes
    p_flat = P.allocate((total,), torch.uint8, "cuda:0")
    d_flat = D.allocate((total,), torch.uint8, "cuda:1")
    fill_random(p_flat, SEEDS[0])
    fill_random(d_flat, SEEDS[1])
    p_ref = torch.empty_like(d_flat)  # P's bytes on GPU 1, to check against
    fill_random(p_ref, SEEDS[0])
    p_mem, d_mem = P.register(p_flat), D.register(d_flat)
    P.connect(D.engine_desc())
    D.connect(P.engine_desc())

    result["ceiling"] = ceiling(p_flat, d_flat, iters)
    ceil_gbps = result["ceiling"]["gbps"]
    print(f"(a) contiguous 1 GiB peer copy: {ceil_gbps:.1f} GB/s", flush=True)
    P.time_transfers = D.time_transfers = True

    # Kernel variants first, on the raw launcher; the agents then run the best one.
    lm = KVLayout(**LAYOUT_KW, order=LAYER_MAJOR)
    srng = np.random.default_rng(7)
    sweep_plans = {
        f"layer_major/{t}": plan_blocks(
            srng.choice(2048, t // 16, replace=False), srng.choice(2048, t // 16, replace=False), lm, lm
        )
        for t in (128, 1024)
    }
    # the 1k case's 4,096 segments of 32 KiB, but in order: per-segment cost without the scatter
    in_order = np.arange(4096, dtype=np.int64) * lm.segment_bytes
    sweep_plans["in_order/4096x32KiB"] = TransferPlan(
        in_order, in_order.copy(), np.full(4096, lm.segment_bytes)
    )
    sweep_plans["contiguous/256MiB"] = TransferPlan(
        np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([256 << 20], np.int64)
    )
    if "sweep" not in skip:
        result["sweep"] = sweep(p_flat, d_flat, sweep_plans, iters)
        chosen = best_variant(result["sweep"], "layer_major/1024")
        cuda_kernels.DEFAULT_VARIANT = chosen
        result["variant"] = dataclasses.asdict(chosen)
        print(f"kernel variant chosen by the sweep: {chosen}", flush=True)
        for r in sorted(result["sweep"], key=lambda r: (r["case"], r["op"], -r["gbps"]))[::1]:
            if r["case"] == "layer_major/1024":
                print(
                    f"   {r['op']:5} u{r['unroll']} c{r['ctas_per_sm']} t{r['threads']} ch{r['chunk_bytes']} "
                    f"s{int(r['streaming'])}: {r['gbps']:6.1f} GB/s",
                    flush=True,
                )

    one = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), np.array([1 << 30], dtype=np.int64)
    for op, agent, dev in (("read", D, 1), ("write", P, 0)):
        mems = (d_mem, p_mem) if op == "read" else (p_mem, d_mem)
        t = time_device(agent.stream(dev), lambda a=agent, m=mems, o=op: getattr(a, o)(*m, *one), iters)
        result["ceiling"][f"kernel_{op}_gbps"] = (1 << 30) / t / GB
        print(f"    the same through the cuda_ipc kernel ({op}): {(1 << 30) / t / GB:.1f} GB/s", flush=True)

    rng = np.random.default_rng(42)
    rows, cases = [], []
    for order in (LAYER_MAJOR, BLOCK_MAJOR):
        layout = KVLayout(**LAYOUT_KW, order=order)
        for tokens in PROMPTS:
            n = tokens // layout.block_size
            d_blocks = rng.choice(layout.num_blocks, n, replace=False)
            p_blocks = rng.choice(layout.num_blocks, n, replace=False)
            plan = plan_blocks(d_blocks, p_blocks, layout, layout)  # local = D
            name = f"{order}/{tokens}"
            cases.append(
                {
                    "name": name,
                    "order": order,
                    "d_blocks": d_blocks,
                    "p_blocks": p_blocks,
                    "d_off": plan.local_offsets,
                    "p_off": plan.remote_offsets,
                    "sizes": plan.sizes,
                }
            )
            row: dict[str, Any] = {
                "case": name,
                "order": order,
                "tokens": tokens,
                "bytes": plan.num_bytes,
                "segments": plan.num_segments,
            }

            def pull(plan: Any = plan) -> Any:
                return D.read(d_mem, p_mem, plan.local_offsets, plan.remote_offsets, plan.sizes)

            def push(plan: Any = plan) -> Any:
                return P.write(p_mem, d_mem, plan.remote_offsets, plan.local_offsets, plan.sizes)

            for op, issue, agent, dev in (("read", pull, D, 1), ("write", push, P, 0)):
                fill_random(d_flat, SEEDS[1] + 1)  # poison D: stale bytes cannot pass the check
                sync()  # a push from GPU 0 is not ordered after GPU 1's streams: finish the poison first
                issue().wait(timeout_s=60)
                row[f"{op}_verified"] = blocks_equal(d_flat, p_ref, layout, d_blocks, p_blocks)
                row[f"{op}_device_s"] = time_device(agent.stream(dev), issue, iters)
                row[f"{op}_host_s"] = time_host(issue, iters)
                row[f"{op}_gbps"] = plan.num_bytes / row[f"{op}_device_s"] / GB
                row[f"{op}_vs_ceiling"] = row[f"{op}_gbps"] / ceil_gbps
            if "naive" not in skip:
                fill_random(d_flat, SEEDS[1] + 2)
                sync()
                t = naive(p_flat, d_flat, plan, 2 if plan.num_segments > 4096 else max(3, iters // 3))
                row["naive_verified"] = blocks_equal(d_flat, p_ref, layout, d_blocks, p_blocks)
                row["naive_s"], row["naive_gbps"] = t, plan.num_bytes / t / GB
            rows.append(row)
            print(
                f"{name:>18}: {plan.num_segments:6d} segs {plan.num_bytes / 2**20:8.1f} MiB | read "
                f"{row['read_gbps']:6.1f} GB/s {row['read_device_s'] * 1e6:8.1f} us (host "
                f"{row['read_host_s'] * 1e6:8.1f}) | write {row['write_gbps']:6.1f} GB/s | naive "
                f"{row.get('naive_gbps', float('nan')):6.2f} GB/s",
                flush=True,
            )
    result["cases"] = rows

    run_phases({"small": lambda: small_phase(P, D, p_mem, iters)}, skip, result)
    P.close()
    D.close()
    p_flat = d_flat = p_ref = torch.empty(0)  # free the caches before the baselines allocate theirs
    torch.cuda.empty_cache()
    run_phases(
        {
            "nccl": lambda: run_nccl(LAYOUT_KW, cases, SEEDS, iters),
            "nixl": lambda: run_nixl(LAYOUT_KW, cases, SEEDS, iters),
        },
        skip,
        result,
    )
    write_outputs(result, Path(args.out))


def run_phases(phases: dict[str, Any], skip: set[str], result: dict[str, Any]) -> None:
    """Run each phase not skipped; a failure is recorded in ``result["errors"]`` and the rest go on."""
    for name, fn in phases.items():
        if name in skip:
            continue
        try:
            result[name] = fn()
        except Exception as exc:
            result["errors"][name] = repr(exc)
            print(f"phase {name} failed: {exc!r}", flush=True)


def small_phase(P: Any, D: Any, p_mem: Any, iters: int) -> list[dict[str, Any]]:
    memcpy_cfg = TransferConfig(backend="cuda_ipc", cuda_ipc=CudaIpcConfig(small_transfer_bytes=1 << 40))
    agents = {"kernel": D, "memcpy_each": create_agent(memcpy_cfg, "D-memcpy")}
    agents["memcpy_each"].time_transfers = True
    d_mems = {"kernel": None, "memcpy_each": None}
    region = {k: a.allocate((4096 * (32 << 10),), torch.uint8, "cuda:1") for k, a in agents.items()}
    for k, a in agents.items():
        d_mems[k] = a.register(region[k])
        a.connect(P.engine_desc())
    try:
        return small(agents, p_mem, d_mems, iters)
    finally:
        agents["memcpy_each"].close()


def write_outputs(result: dict[str, Any], out: Path) -> None:
    from transfer_gpu_report import plot, summarize

    out.mkdir(parents=True, exist_ok=True)
    summarize(result)
    (out / "transfer_gpu.json").write_text(json.dumps(result, indent=1, default=str))
    plot(result, out / "transfer_gpu.png")
    print(json.dumps(result["summary"], indent=1))
    if result["errors"]:
        print("errors:", json.dumps(result["errors"], indent=1))


if __name__ == "__main__":
    main()
