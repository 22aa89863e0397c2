"""Transfer under load (``transfer_gpu_bench.py --phases load``): decode steps of the engine in one
process while D's worker (another process, same GPU) pulls a prompt's KV from P back to back.

The engine is the real one (``llama-1b``, bf16, CUDA graphs, colocated role) with ``BATCH``
sequences decoding. For each transfer method the engine times ``STEPS`` decode steps while the
transfers run; the same number of steps with no transfer, before and after every method, is the
baseline (their mean, so slow drift cancels). The transfer's own time under load is compared with
its time alone, measured right before in the same phase.
"""

from __future__ import annotations

import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

BATCH = 64
PROMPT_LEN = 128
STEPS = 40
WARMUP_STEPS = 10


def engine_main(conn: Connection, device: int) -> None:
    """The decode process: builds the engine, then answers ``("steps", n)`` with n step times (s)."""
    try:
        torch.cuda.set_device(device)
        from moriio_ray.config import EngineConfig, ModelConfig
        from moriio_ray.engine.engine import Engine
        from moriio_ray.engine.sampling import SamplingParams

        engine = Engine(
            ModelConfig(preset="llama-1b", dtype="bfloat16", max_model_len=2048),
            EngineConfig(
                device="cuda", num_blocks=8192, max_num_seqs=BATCH, max_num_batched_tokens=BATCH * PROMPT_LEN
            ),
            role="colocated",
            cuda_graphs=True,
        )
        gen = torch.Generator().manual_seed(0)
        params = SamplingParams(max_tokens=1800, ignore_eos=True)
        for i, prompt in enumerate(torch.randint(0, 256, (BATCH, PROMPT_LEN), generator=gen).tolist()):
            engine.add_request(f"load-{i}", prompt, params)
        engine.step()  # the prefill of all of them
        for _ in range(WARMUP_STEPS):
            engine.step()
        torch.cuda.synchronize()
        conn.send(("ok", "ready"))
    except Exception as exc:
        conn.send(("error", repr(exc)))
        return
    while True:
        cmd, args = conn.recv()  # ("steps", (n,)) or ("exit", ())
        if cmd == "exit":
            conn.send(("ok", None))
            return
        try:
            times, batch = [], BATCH
            for _ in range(int(args[0])):
                t0 = time.perf_counter()
                outs = engine.step()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                batch = min(batch, len(outs))
            if batch != BATCH:  # the steps did not all decode the whole batch: not comparable
                raise RuntimeError(f"a decode step produced {batch} outputs, expected {BATCH}")
            conn.send(("ok", times))
        except Exception as exc:
            conn.send(("error", repr(exc)))


def _ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 3)


def run_load(
    engine: Any, d: Any, stop: Any, case_name: str, variants: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """``engine`` and ``d`` are ``Proc`` handles (``transfer_gpu_bench.py``); returns the phase's rows."""
    rows = []
    idle_before = engine.call("steps", STEPS)
    for label, variant in variants.items():
        row: dict[str, Any] = {"variant": label, **variant}
        looping = False
        try:
            alone = d.call("measure", "cuda_ipc", "read", case_name, variant, 10)
            row["transfer_alone_us"] = alone["host_us"]
            row["method"] = alone["method"]
            stop.clear()
            d.send("loop", "cuda_ipc", "read", case_name, variant)
            d.answer(120)  # "started": the first transfer ran
            looping = True
            loaded = engine.call("steps", STEPS)
            stop.set()
            looping = False
            looped = d.answer(120)
            idle_after = engine.call("steps", STEPS)
            base = (statistics.median(idle_before) + statistics.median(idle_after)) / 2
            row.update(
                step_ms_idle=round(base * 1e3, 3),
                step_ms_loaded=_ms(loaded),
                decode_slowdown=round(statistics.median(loaded) / base - 1, 4),
                transfers_during=looped["transfers"],
                transfer_loaded_us=looped["transfer_us"],
            )
            if row["transfer_alone_us"] and row["transfer_loaded_us"]:
                row["transfer_slowdown"] = round(row["transfer_loaded_us"] / row["transfer_alone_us"] - 1, 4)
            idle_before = idle_after
        except Exception as exc:
            stop.set()
            row["error"] = repr(exc)[:500]
            if looping:  # the worker still owes the loop's answer: take it, so the pipe stays in step
                try:
                    d.answer(120)
                except Exception as late:
                    row["error"] += f"; then {late!r}"[:300]
        rows.append(row)
        print(f"  load {label:>24}: {row}", flush=True)
    return {"case": case_name, "batch": BATCH, "steps": STEPS, "rows": rows}
