"""What a user would pick instead of cuda_ipc, measured for ``transfer_gpu_bench.py``.

- NIXL (``nixl-cu13``, UCX backend) in push mode: an initiator process on GPU 0 WRITEs the segments
  into a target process's registered cache on GPU 1. Timed on the host from ``transfer`` to the state
  "DONE" of a prepared request (its creation is timed apart).
- NCCL send/recv through ``torch.distributed`` (two processes): P gathers the blocks into one
  buffer (``index_select``), sends it; D receives and scatters (``index_copy_``). Timed on D from a
  barrier to the scattered result.

Both run in child processes (spawned), so a crash there cannot take the main benchmark down. Each
checks once that the right bytes arrived.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from moriio_ray.transfer.layout import LAYER_MAJOR, KVLayout

Case = dict[str, Any]  # name, order, d_blocks, p_blocks, d_off, p_off, sizes


def fill_random(flat: torch.Tensor, seed: int) -> None:
    """Fill a uint8 GPU tensor with seeded random bytes (the same bytes on any GPU of one model)."""
    gen = torch.Generator(device=flat.device).manual_seed(seed)
    flat.view(torch.int32).random_(generator=gen)


def blocks_equal(
    dst: torch.Tensor, src: torch.Tensor, layout: KVLayout, d_blocks: np.ndarray, p_blocks: np.ndarray
) -> bool:
    """Whether dst's blocks ``d_blocks`` hold src's blocks ``p_blocks`` (flat uint8 tensors, one device)."""
    shape = layout.shape
    d5 = dst.view(torch.int16).view(shape)
    s5 = src.view(torch.int16).view(shape)
    di = torch.as_tensor(d_blocks, device=dst.device)
    si = torch.as_tensor(p_blocks, device=dst.device)
    dim = 2 if layout.order == LAYER_MAJOR else 0
    return bool(torch.equal(d5.index_select(dim, di), s5.index_select(dim, si)))


def _await(conn: Connection, procs: list[Any], timeout_s: float, what: str) -> None:
    """Wait for a message, failing at once if one of ``procs`` died first."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(1.0):
        dead = [p for p in procs if p.exitcode is not None]
        if dead:
            raise RuntimeError(f"{what}: a child process exited with code {dead[0].exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} gave no result within {timeout_s} s")


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


# ----------------------------------------------------------------------------------------------
# NCCL


def _nccl_rank(
    rank: int,
    port: int,
    layout_kw: dict[str, Any],
    cases: list[Case],
    seeds: tuple[int, int],
    iters: int,
    conn: Connection,
) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=dev
    )
    out: list[dict[str, Any]] = []
    for case in cases:
        layout = KVLayout(**layout_kw, order=case["order"])
        cache = torch.empty(layout.total_bytes, dtype=torch.uint8, device=dev)
        fill_random(cache, seeds[rank])
        view = cache.view(torch.bfloat16).view(layout.shape)  # NCCL moves bf16 (not int16); bits unchanged
        dim = 2 if layout.order == LAYER_MAJOR else 0
        idx = torch.as_tensor(case["p_blocks"] if rank == 0 else case["d_blocks"], device=dev)
        shape = list(layout.shape)
        shape[dim] = idx.numel()
        buf = torch.empty(shape, dtype=torch.bfloat16, device=dev)

        times = []
        for i in range(iters + 3):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if rank == 0:  # P: gather the blocks into one buffer, send it
                torch.index_select(view, dim, idx, out=buf)
                dist.send(buf, 1)
            else:  # D: receive, scatter into the blocks
                dist.recv(buf, 0)
                view.index_copy_(dim, idx, buf)
            torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        ok = None
        if rank == 1:
            src = torch.empty_like(cache)
            fill_random(src, seeds[0])
            ok = blocks_equal(cache, src, layout, case["d_blocks"], case["p_blocks"])
            del src
            out.append({"name": case["name"], "host_s": _median(times), "verified": ok})
        torch.cuda.empty_cache()
    if rank == 1:
        conn.send(out)
    dist.barrier()
    dist.destroy_process_group()


def run_nccl(
    layout_kw: dict[str, Any], cases: list[Case], seeds: tuple[int, int], iters: int, timeout_s: float = 300.0
) -> list[dict[str, Any]]:
    """NCCL send/recv of each case's blocks, GPU 0 -> GPU 1, in two spawned processes."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    procs = [
        ctx.Process(target=_nccl_rank, args=(r, port, layout_kw, cases, seeds, iters, child)) for r in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        _await(parent, procs, timeout_s, "NCCL baseline")
        result: list[dict[str, Any]] = parent.recv()
        return result
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


# ----------------------------------------------------------------------------------------------
# NIXL


def _nixl() -> Any:
    try:
        import nixl_cu13 as nixl
    except ImportError:
        from nixl import _api as nixl  # the meta package's layout
    return nixl


def _nixl_target(
    conn: Connection, total_bytes: int, layout_kw: dict[str, Any], seeds: tuple[int, int]
) -> None:
    nixl = _nixl()
    torch.cuda.set_device(1)
    cache = torch.empty(total_bytes, dtype=torch.uint8, device="cuda:1")
    fill_random(cache, seeds[1])
    agent = nixl.nixl_agent("D", nixl.nixl_agent_config(backends=["UCX"]))
    agent.register_memory(cache)
    conn.send((agent.get_agent_metadata(), cache.data_ptr()))
    while True:
        msg = conn.recv()
        if msg[0] == "verify":
            _, order, d_blocks, p_blocks = msg
            torch.cuda.synchronize()
            src = torch.empty_like(cache)
            fill_random(src, seeds[0])
            conn.send(blocks_equal(cache, src, KVLayout(**layout_kw, order=order), d_blocks, p_blocks))
            del src
        else:
            break


def _nixl_initiator(
    conn: Connection,
    meta: bytes,
    d_base: int,
    total_bytes: int,
    cases: list[Case],
    seeds: tuple[int, int],
    iters: int,
) -> None:
    nixl = _nixl()
    torch.cuda.set_device(0)
    cache = torch.empty(total_bytes, dtype=torch.uint8, device="cuda:0")
    fill_random(cache, seeds[0])
    agent = nixl.nixl_agent("P", nixl.nixl_agent_config(backends=["UCX"]))
    agent.register_memory(cache)
    remote = agent.add_remote_agent(meta)
    agent.make_connection(remote)
    p_base = cache.data_ptr()
    out = []
    for case in cases:
        sizes = case["sizes"].astype(np.uint64)
        local = np.stack([p_base + case["p_off"].astype(np.uint64), sizes, np.zeros_like(sizes)], axis=1)
        far = np.stack([d_base + case["d_off"].astype(np.uint64), sizes, np.ones_like(sizes)], axis=1)
        t0 = time.perf_counter()
        handle = agent.initialize_xfer(
            "WRITE", agent.get_xfer_descs(local, "VRAM"), agent.get_xfer_descs(far, "VRAM"), remote
        )
        create_s = time.perf_counter() - t0
        times = []
        for i in range(iters + 3):
            t0 = time.perf_counter()
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer state {state} for {case['name']}")
            if i >= 3:
                times.append(time.perf_counter() - t0)
        backend = agent.query_xfer_backend(handle)
        agent.release_xfer_handle(handle)
        out.append({"name": case["name"], "host_s": _median(times), "create_s": create_s, "backend": backend})
    conn.send(out)


def run_nixl(
    layout_kw: dict[str, Any], cases: list[Case], seeds: tuple[int, int], iters: int, timeout_s: float = 300.0
) -> list[dict[str, Any]]:
    """NIXL WRITE of each case, GPU 0 -> GPU 1, initiator and target in two spawned processes.

    The last case's bytes are checked in the target afterwards (``verified`` on that entry).
    """
    _nixl()  # fail here, in the parent, when NIXL is not installed
    total = KVLayout(**layout_kw, order=LAYER_MAJOR).total_bytes
    ctx = mp.get_context("spawn")
    t_conn, t_child = ctx.Pipe()
    i_conn, i_child = ctx.Pipe()
    target = ctx.Process(target=_nixl_target, args=(t_child, total, layout_kw, seeds))
    target.start()
    init = None
    try:
        _await(t_conn, [target], 120, "NIXL target")
        meta, d_base = t_conn.recv()
        init = ctx.Process(target=_nixl_initiator, args=(i_child, meta, d_base, total, cases, seeds, iters))
        init.start()
        _await(i_conn, [init, target], timeout_s, "NIXL initiator")
        out: list[dict[str, Any]] = i_conn.recv()
        last = cases[-1]
        t_conn.send(("verify", last["order"], last["d_blocks"], last["p_blocks"]))
        if t_conn.poll(120):
            out[-1]["verified"] = t_conn.recv()
        t_conn.send(("stop",))
        return out
    finally:
        for p in (init, target):
            if p is not None:
                p.join(30)
                if p.is_alive():
                    p.kill()
