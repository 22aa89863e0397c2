"""Where the host time of one cuda_ipc transfer goes (``transfer_gpu_bench.py --phases breakdown``).

Each step of the issue path is timed alone, many times, on the case's own arrays (median, in µs):
the base class's checks, the method choice, stream ordering, metadata staging, the launch, the
completion event, and the wait. For comparison it also times what the previous path used: a CuPy
launch, a torch event record, and torch's stream switch. The GPU queue is drained every
``DRAIN`` launches, so that it never fills.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.transfer_gpu_cases import Case

ITERS = 300
DRAIN = 50


def _time(fn: Callable[[], Any], iters: int = ITERS, sync: Callable[[], Any] | None = None) -> float:
    out = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        if sync is not None and i % DRAIN == DRAIN - 1:
            sync()
    if sync is not None:
        sync()
    return round(statistics.median(out[5:]) * 1e6, 2)


def breakdown(backend: Any, c: Case, variant: dict[str, Any]) -> dict[str, Any]:
    from moriio_ray.transfer import cuda_driver, cuda_methods
    from moriio_ray.transfer.base import as_segments, check_bounds
    from moriio_ray.transfer.cuda_kernels import KernelVariant, SegmentCopier

    agent, mem, peer_mem = backend.agent, backend.mem, backend.peer_mem
    issue = backend.prepare("read", c, variant)
    issue().wait(timeout_s=60)
    dev = torch.device("cuda", backend.device)
    lane = agent._lane(dev)
    sync = lane.stream.synchronize
    lo, ro, sz = c.d_off, c.p_off, c.sizes
    out: dict[str, Any] = {"case": c.name, "segments": c.num_segments, "variant": variant}

    def e2e() -> None:
        issue().wait(timeout_s=60)

    out["end_to_end_us"] = _time(e2e)
    pending: list[Any] = []

    def drain() -> None:
        sync()
        pending.clear()

    out["issue_only_us"] = _time(lambda: pending.append(issue()), sync=drain)
    waits = []
    for _ in range(100):
        x = issue()
        t0 = time.perf_counter()
        x.wait(timeout_s=60)
        waits.append(time.perf_counter() - t0)
    out["wait_after_issue_us"] = round(statistics.median(waits) * 1e6, 2)

    def checks() -> None:
        a, b, s = as_segments(lo, ro, sz)
        check_bounds(a, s, mem.num_bytes, "local", "x")
        check_bounds(b, s, peer_mem.num_bytes, "remote", "y")

    out["base_checks_us"] = _time(checks)
    cfg = agent.config.cuda_ipc
    out["describe_and_choose_us"] = _time(
        lambda: cuda_methods.choose(
            cfg.method,
            cuda_methods.describe(sz),
            small_transfer_bytes=cfg.small_transfer_bytes,
            copy_engine_segment_bytes=cfg.copy_engine_segment_bytes,
        )
    )
    out["peer_alive_us"] = _time(lambda: agent._peer_alive(peer_mem.engine_key, thorough=False))
    seg = cuda_methods.describe(sz)
    src, _ = agent._remote_region(agent.peers()[peer_mem.engine_key], peer_mem, dev.index)
    dst = backend.agent.local_tensor(mem).data_ptr()
    getter = agent._current_stream
    with cuda_driver.ContextGuard(lane.ctx):
        out["context_guard_us"] = _time(lambda: cuda_driver.ContextGuard(lane.ctx).__enter__())

        def order() -> None:
            lane.order.record(getter(lane.index))
            cuda_driver.stream_wait(lane.handle, lane.order)

        out["stream_order_us"] = _time(order)
        out["stage_metadata_us"] = _time(lambda: lane.copier._stage(ro, lo, sz, seg), sync=sync)
        out["stage_and_launch_us"] = _time(lambda: lane.copier.copy(src, dst, ro, lo, sz, seg), sync=sync)
        kv = variant.get("kernel")
        cupy = SegmentCopier(dev, lane.stream, KernelVariant(**kv) if kv else None, launcher="cupy")
        out["stage_and_cupy_launch_us"] = _time(lambda: cupy.copy(src, dst, ro, lo, sz, seg), sync=sync)
        out["copy_engine_batch_submit_us"] = _time(
            lambda: lane.engine.copy(src, dst, ro, lo, sz, lane.handle), iters=60, sync=sync
        )

        def raw_event() -> None:
            cuda_driver.RawEvent().record(lane.handle)

        out["raw_event_create_record_us"] = _time(raw_event, sync=sync)
        ev = cuda_driver.RawEvent()
        ev.record(lane.handle)
        sync()
        out["raw_event_query_us"] = _time(ev.query)

    def torch_event() -> None:
        torch.cuda.Event().record(lane.stream)

    out["torch_event_record_us"] = _time(torch_event, sync=sync)

    def torch_switch() -> None:
        with torch.cuda.device(dev.index), torch.cuda.stream(lane.stream):
            lane.stream.wait_stream(torch.cuda.current_stream(dev))

    out["torch_device_stream_switch_us"] = _time(torch_switch, sync=sync)
    out["launch_us"] = round(out["stage_and_launch_us"] - out["stage_metadata_us"], 2)
    out["cupy_launch_us"] = round(out["stage_and_cupy_launch_us"] - out["stage_metadata_us"], 2)
    return out
