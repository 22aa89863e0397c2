"""A lean streaming load client for ``POST /v1/completions`` (the protocol is in bench/serving_http.py).

At tens of thousands of SSE events per second a general-purpose client (httpx) saturates one core,
so ``run_http_cell`` spreads a cell's streams over several child processes, each running this file:

    python bench/serving_client.py      # reads a plan (JSON) on stdin; see ``child_main``

Each child opens its connections, prints ``ready``, waits for ``go`` on stdin, keeps its share of
the concurrency in flight (closed loop), and prints its records and its own CPU time as JSON.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for bench

from bench.serving_http import Connection, stream_completion
from bench.serving_stats import Record

T = TypeVar("T")


async def closed_loop(
    items: list[T],
    concurrency: int,
    run_one: Callable[[int, T], Awaitable[Record]],
    *,
    soft_deadline_s: float | None,
    timeout_s: float,
    on_timeout: Callable[[int, T], Record],
) -> list[Record]:
    """Keep ``concurrency`` items in flight, the next starting as one ends, until none is left.

    ``run_one(slot, item)`` runs one item on worker ``slot``. After ``soft_deadline_s`` (an absolute
    perf_counter time) no new item starts; the running ones finish. Each item has ``timeout_s``.
    """
    queue = collections.deque(items)
    records: list[Record] = []

    async def worker(slot: int) -> None:
        while queue and (soft_deadline_s is None or time.perf_counter() < soft_deadline_s):
            item = queue.popleft()
            try:
                records.append(await asyncio.wait_for(run_one(slot, item), timeout_s))
            except asyncio.TimeoutError:
                records.append(on_timeout(slot, item))

    await asyncio.gather(*(worker(slot) for slot in range(concurrency)))
    return records


# ----------------------------------------------------------------------------------------------
# the child process


class Plan(msgspec.Struct, kw_only=True):
    """What a client child runs: its share of one cell."""

    url: str  # e.g. http://127.0.0.1:8000/v1/completions
    concurrency: int
    indices: list[int]
    bodies: list[dict[str, Any]]  # the JSON bodies, in the order of ``indices``
    soft_deadline_s: float | None  # seconds after ``go`` after which no new request starts
    timeout_s: float


class ChildResult(msgspec.Struct, kw_only=True):
    records: list[Record]
    cpu_s: float  # this process's CPU time from ``go`` to the end
    wall_s: float


async def _child(plan: Plan) -> ChildResult:
    parts = urlsplit(plan.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    encoder = msgspec.json.Encoder()
    items = [
        (i, encoder.encode(b), bool((b.get("stream_options") or {}).get("include_usage")))
        for i, b in zip(plan.indices, plan.bodies, strict=True)
    ]
    conns = [Connection(host, port) for _ in range(plan.concurrency)]
    await asyncio.gather(*(c.open() for c in conns))  # connected before the clock starts
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # "go"
    cpu0, t0 = time.process_time(), time.perf_counter()
    soft = None if plan.soft_deadline_s is None else t0 + plan.soft_deadline_s

    async def one(slot: int, item: tuple[int, bytes, bool]) -> Record:
        return await stream_completion(conns[slot], parts.path, item[0], item[1], check_usage=item[2])

    def timed_out(slot: int, item: tuple[int, bytes, bool]) -> Record:
        conns[slot].close()  # a half-read response poisons the connection
        now = time.perf_counter()
        return Record(index=item[0], sent_s=now, done_s=now, error=f"no answer within {plan.timeout_s} s")

    records = await closed_loop(
        items, plan.concurrency, one, soft_deadline_s=soft, timeout_s=plan.timeout_s, on_timeout=timed_out
    )
    for c in conns:
        c.close()
    return ChildResult(records=records, cpu_s=time.process_time() - cpu0, wall_s=time.perf_counter() - t0)


def child_main() -> None:
    """Read a Plan (one JSON line) on stdin, run it, write a ChildResult (JSON) on stdout."""
    plan = msgspec.json.decode(sys.stdin.readline().encode(), type=Plan)
    result = asyncio.run(_child(plan))
    sys.stdout.write(msgspec.json.encode(result).decode() + "\n")


# ----------------------------------------------------------------------------------------------
# the parent side


def split_concurrency(concurrency: int, num_procs: int) -> list[int]:
    """Streams per client process: ``concurrency`` spread as evenly as possible over at most
    ``num_procs`` processes (never an idle one)."""
    procs = max(1, min(num_procs, concurrency))
    return [concurrency // procs + (i < concurrency % procs) for i in range(procs)]


def assign(num_items: int, shares: list[int]) -> list[list[int]]:
    """Item indices per process, in order, each process getting items in proportion to its share."""
    out: list[list[int]] = [[] for _ in shares]
    for i in range(num_items):
        k = min(range(len(shares)), key=lambda p: (len(out[p]) / shares[p], p))
        out[k].append(i)
    return out


class ClientStats(msgspec.Struct, kw_only=True):
    num_procs: int
    cpu_s: list[float]
    wall_s: list[float]

    @property
    def max_utilization(self) -> float:
        """The busiest client process's CPU time over its wall time (near 1.0: it was the bottleneck)."""
        return max((c / w for c, w in zip(self.cpu_s, self.wall_s, strict=True) if w > 0), default=0.0)


async def run_http_cell(
    url: str,
    bodies: list[dict[str, Any]],
    concurrency: int,
    *,
    num_procs: int,
    soft_deadline_s: float | None,
    timeout_s: float,
    start_timeout_s: float = 30.0,
) -> tuple[list[Record], ClientStats]:
    """Run one closed-loop cell of streaming requests from child processes; their records merged."""
    shares = split_concurrency(concurrency, num_procs)
    groups = assign(len(bodies), shares)
    procs: list[asyncio.subprocess.Process] = []
    try:
        for share, idx in zip(shares, groups, strict=True):
            plan = Plan(
                url=url,
                concurrency=share,
                indices=idx,
                bodies=[bodies[i] for i in idx],
                soft_deadline_s=soft_deadline_s,
                timeout_s=timeout_s,
            )
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                str(Path(__file__).resolve()),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            procs.append(proc)
            assert proc.stdin is not None
            proc.stdin.write(msgspec.json.encode(plan) + b"\n")
            await proc.stdin.drain()
        for proc in procs:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), start_timeout_s)
            if line.strip() != b"ready":
                _, err = await asyncio.wait_for(proc.communicate(), 10.0)
                raise RuntimeError(f"a client process did not start: {err.decode(errors='replace')[-800:]}")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()
        # every request has timeout_s; after the soft deadline none starts
        waves = 1 if soft_deadline_s is not None else -(-len(bodies) // concurrency)
        total_s = (soft_deadline_s or 0.0) + timeout_s * waves + 30.0
        outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), total_s)
    finally:
        for proc in procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), 10.0)
    records: list[Record] = []
    stats = ClientStats(num_procs=len(procs), cpu_s=[], wall_s=[])
    for proc, (out, err) in zip(procs, outs, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(f"a client process failed: {err.decode(errors='replace')[-800:]}")
        result = msgspec.json.decode(out.strip().splitlines()[-1], type=ChildResult)
        records.extend(result.records)
        stats.cpu_s.append(result.cpu_s)
        stats.wall_s.append(result.wall_s)
    return records, stats


if __name__ == "__main__":
    child_main()
