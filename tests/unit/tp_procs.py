"""Run one tensor-parallel engine over several processes (gloo on the CPU), for the engine TP tests.

The test process hosts the rendezvous store on an ephemeral port; each child joins the group,
builds its rank (rank 0 an ``Engine``, the others a ``RankEngine``) with its own transfer agent,
and reports its results and its KV shard on a queue.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from datetime import timedelta
from typing import Any

import torch

from moriio_ray.config import EngineConfig, ModelConfig, TransferConfig
from moriio_ray.engine.sampling import SamplingParams

START_TIMEOUT = timedelta(seconds=60)


def model_config() -> ModelConfig:
    return ModelConfig(preset="tiny", dtype="float32", seed=0)


def engine_config(device: str = "cpu", num_blocks: int = 64, budget: int = 4096) -> EngineConfig:
    return EngineConfig(
        device=device, block_size=4, num_blocks=num_blocks, max_num_seqs=16, max_num_batched_tokens=budget
    )


def reference(
    prompts: list[list[int]], params: SamplingParams, device: str = "cpu", budget: int = 4096
) -> dict[str, Any]:
    """Tokens and the final KV cache of the same requests on one rank (TP = 1), in this process."""
    from moriio_ray.engine.engine import Engine

    engine = Engine(model_config(), engine_config(device, budget=budget), role="colocated")
    return {"tokens": _run(engine, prompts, params)[0], "cache": engine.kv_cache.cpu().numpy().copy()}


def _run(engine: Any, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], int]:
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    steps = 0
    while engine.has_work():
        steps += 1
        for step in engine.step():
            out[step.request_id].extend(step.new_token_ids)
    return [out[str(i)] for i in range(len(prompts))], steps


def rank_main(
    rank: int, size: int, port: int, device: str, prompts: list[list[int]], results: Any, budget: int
) -> None:
    """One rank's process: join, build, run (rank 0) or follow (the others), report."""
    try:
        import torch.distributed as dist

        from moriio_ray.engine.engine import Engine
        from moriio_ray.engine.rank import RankEngine
        from moriio_ray.engine.tp import destroy_group, init_group
        from moriio_ray.transfer import create_agent

        torch.set_num_threads(1)
        if device == "cuda":
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=START_TIMEOUT)
        dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
        tp = init_group(rank, size, store, dev)
        backend = "tcp" if device == "cuda" else "shm"  # tcp stages GPU memory; no CuPy needed
        agent = create_agent(TransferConfig(backend=backend), key=f"tp-test-r{rank}")
        report: dict[str, Any] = {"rank": rank}
        if rank == 0:
            config = engine_config(device, budget=budget)
            engine = Engine(model_config(), config, role="colocated", agent=agent, tp=tp)
            report["graphs"] = engine.capture_graphs()
            params = SamplingParams(max_tokens=16, ignore_eos=True)
            report["tokens"], report["steps"] = _run(engine, prompts, params)
            report["messages"] = engine._steps.num_sent if engine._steps is not None else 0
            report["replays"] = engine.graphs.num_replays if engine.graphs is not None else 0
            report["layout"], report["cache"] = (
                engine.layout,
                engine.kv_cache.cpu().numpy().copy(),
            )  # numpy: tensors would travel as fds
            report["mem_bytes"] = engine.kv_mem.num_bytes if engine.kv_mem is not None else 0
            engine.close()  # STOP: the other ranks leave their loops
        else:
            config = engine_config(device, budget=budget)
            follower = RankEngine(model_config(), config, role="colocated", tp=tp, agent=agent)
            follower.follow()
            graphs = follower.parts.graphs
            report["steps"] = follower.num_steps
            report["replays"] = graphs.num_replays if graphs is not None else 0
            report["layout"], report["cache"] = follower.layout, follower.cache.tensor.cpu().numpy().copy()
            report["mem_bytes"] = follower.kv_mem.num_bytes if follower.kv_mem is not None else 0
            follower.close()
        agent.close()
        destroy_group(tp)
        results.put(report)
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})


def run_ranks(
    size: int, prompts: list[list[int]], device: str = "cpu", timeout_s: float = 90.0, budget: int = 4096
) -> list[dict]:
    """Start ``size`` rank processes and collect their reports (rank order); fails on any error."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=START_TIMEOUT)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=rank_main, args=(r, size, store.port, device, prompts, results, budget), daemon=True
        )
        for r in range(size)
    ]
    for p in procs:
        p.start()
    reports: dict[int, dict] = {}
    try:
        while len(reports) < size:
            try:
                report = results.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(
                    f"ranks {sorted(set(range(size)) - set(reports))} did not report"
                ) from None
            assert "error" not in report, f"rank {report['rank']} failed:\n{report['error']}"
            reports[report["rank"]] = report
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [reports[r] for r in range(size)]
