"""A lean streaming client for ``POST /v1/completions``: HTTP/1.1 and SSE parsed incrementally with no
HTTP library (at tens of thousands of SSE events per second httpx saturates a core), the load
drivers (closed loop, Poisson arrivals), and ``run_http_cell``, which spreads a cell over child
processes running this file (``python -m bench.http_client`` reads a plan on stdin, answers
``ready``, waits for ``go``, and prints its records and CPU time as JSON). No torch, no Ray.

Times are ``time.perf_counter()`` readings: CLOCK_MONOTONIC on Linux, shared by every process."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import msgspec

from bench.http_wire import (
    ChunkedDecoder,
    ProtocolError,
    SSEParser,
    read_event,
)

T = TypeVar("T")
_ROOT = str(Path(__file__).resolve().parents[1])
_READ_BYTES = 1 << 16


class Record(msgspec.Struct, kw_only=True):
    """What the client saw of one request (perf_counter seconds; 0.0 where it never happened)."""

    index: int
    sent_s: float = 0.0
    first_s: float = 0.0
    last_s: float = 0.0
    done_s: float = 0.0
    num_tokens: int = 0
    num_chunks: int = 0  # token-carrying messages (SSE events, stream events, engine outputs)
    status: int = 0  # HTTP status; 200 for the in-process systems
    error: str | None = None
    extra: dict[str, Any] | None = None  # the Python API's last Timings, cached tokens, token ids

    def add_tokens(self, now_s: float, num_tokens: int) -> None:
        if self.num_tokens == 0:
            self.first_s = now_s
        self.last_s = now_s
        self.num_tokens += num_tokens
        self.num_chunks += 1

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and self.num_tokens > 0

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        return None if self.num_tokens < 2 else (self.last_s - self.first_s) / (self.num_tokens - 1)


def arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Poisson arrival offsets (s) of ``count`` requests at ``rate`` per second."""
    rng, at, out = random.Random(f"{seed}:{rate}"), 0.0, []
    for _ in range(count):
        at += rng.expovariate(rate)
        out.append(at)
    return out


async def drive(
    items: list[T],
    run_one: Callable[[int, T], Awaitable[Record]],
    on_timeout: Callable[[int, T], Record],
    *,
    timeout_s: float,
    concurrency: int = 1,
    at_s: list[float] | None = None,
) -> list[Record]:
    """Closed loop (``concurrency`` in flight, the next starting as one ends), or, with ``at_s``,
    each item at its offset from now (open loop). ``run_one(slot, item)``; each has ``timeout_s``."""

    async def guarded(slot: int, item: T) -> Record:
        try:
            return await asyncio.wait_for(run_one(slot, item), timeout_s)
        except asyncio.TimeoutError:
            return on_timeout(slot, item)

    if at_s is None:
        queue, records = collections.deque(items), []

        async def worker(slot: int) -> None:
            while queue:
                records.append(await guarded(slot, queue.popleft()))

        await asyncio.gather(*(worker(slot) for slot in range(concurrency)))
        return records
    t0 = time.perf_counter()

    async def at(slot: int, item: T, when: float) -> Record:
        await asyncio.sleep(max(0.0, when - (time.perf_counter() - t0)))
        return await guarded(slot, item)

    return list(
        await asyncio.gather(*(at(i, x, w) for i, (x, w) in enumerate(zip(items, at_s, strict=True))))
    )


# -- HTTP/1.1 and SSE ------------------------------------------------------------------------------


class Connection:
    """One keep-alive HTTP/1.1 connection; ``stream`` POSTs a JSON body and yields body bytes."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def stream(self, path: str, body: bytes) -> tuple[int, AsyncIterator[bytes]]:
        """(status, body pieces as they arrive); reopens the connection if the server closed it."""
        if self.writer is None or self.writer.is_closing() or self.reader is None:
            await self.open()
        assert self.reader is not None and self.writer is not None
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await self.writer.drain()
        status_line, *lines = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise ProtocolError(f"bad status line {status_line!r}")
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines) if k}
        return int(parts[1]), self._body(headers)

    async def _body(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        assert self.reader is not None
        reader = self.reader
        if headers.get("connection", "").lower() == "close":
            self.reader = None  # not reusable; the next request reconnects
        if "chunked" in headers.get("transfer-encoding", "").lower():
            decoder = ChunkedDecoder()
            while not decoder.done:
                if not (data := await reader.read(_READ_BYTES)):
                    raise ProtocolError("the connection closed inside a chunked body")
                if piece := decoder.feed(data):
                    yield piece
        elif "content-length" in headers:
            left = int(headers["content-length"])
            while left > 0:
                if not (data := await reader.read(min(left, _READ_BYTES))):
                    raise ProtocolError("the connection closed inside the body")
                left -= len(data)
                yield data
        else:
            self.reader = None
            while data := await reader.read(_READ_BYTES):
                yield data
        if self.reader is None:
            self.close()


async def stream_completion(
    conn: Connection, path: str, index: int, body: bytes, *, check_usage: bool = False
) -> Record:
    """Send one streaming completion and time its tokens (one clock reading per socket read). With
    ``check_usage`` a stream whose usage event is missing or counts other tokens is an error."""
    rec = Record(index=index, sent_s=time.perf_counter())
    try:
        status, pieces = await conn.stream(path, body)
        rec.status = status
        if status != 200:
            rec.error = b"".join([p async for p in pieces]).decode(errors="replace")[:300]
            return rec
        sse, used = SSEParser(), None
        async for piece in pieces:
            now = time.perf_counter()
            for event in sse.feed(piece):
                num, usage = read_event(event)
                if num > 0:
                    rec.add_tokens(now, num)
                used = usage if usage is not None else used
        if check_usage and used != rec.num_tokens:
            rec.error = f"usage says {used} completion tokens, the events carried {rec.num_tokens}"
    except (OSError, asyncio.IncompleteReadError, ProtocolError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        conn.close()
    rec.done_s = time.perf_counter()
    return rec


# -- client processes ------------------------------------------------------------------------------


class Plan(msgspec.Struct, kw_only=True):
    """A client child's share of one cell."""

    url: str
    concurrency: int
    indices: list[int]
    bodies: list[dict[str, Any]]
    at_s: list[float] | None  # open loop: each request's offset from ``go``
    timeout_s: float


class ChildResult(msgspec.Struct, kw_only=True):
    records: list[Record]
    cpu_s: float
    wall_s: float


async def _child(plan: Plan) -> ChildResult:
    parts = urlsplit(plan.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    encode = msgspec.json.Encoder().encode
    items = [
        (i, encode(b), bool((b.get("stream_options") or {}).get("include_usage")))
        for i, b in zip(plan.indices, plan.bodies, strict=True)
    ]
    slots = plan.concurrency if plan.at_s is None else len(items)
    conns = [Connection(host, port) for _ in range(slots)]
    if plan.at_s is None:
        await asyncio.gather(*(c.open() for c in conns))  # connected before the clock starts
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # "go"
    cpu0, t0 = time.process_time(), time.perf_counter()

    async def one(slot: int, item: tuple[int, bytes, bool]) -> Record:
        return await stream_completion(conns[slot], parts.path, item[0], item[1], check_usage=item[2])

    def timed_out(slot: int, item: tuple[int, bytes, bool]) -> Record:
        conns[slot].close()  # a half-read response poisons the connection
        now = time.perf_counter()
        return Record(index=item[0], sent_s=now, done_s=now, error=f"no answer within {plan.timeout_s} s")

    records = await drive(
        items, one, timed_out, timeout_s=plan.timeout_s, concurrency=plan.concurrency, at_s=plan.at_s
    )
    for c in conns:
        c.close()
    return ChildResult(records=records, cpu_s=time.process_time() - cpu0, wall_s=time.perf_counter() - t0)


def split_concurrency(concurrency: int, num_procs: int) -> list[int]:
    """Streams per client process, as even as possible over at most ``num_procs`` (none idle)."""
    procs = max(1, min(num_procs, concurrency))
    return [concurrency // procs + (i < concurrency % procs) for i in range(procs)]


def assign(num_items: int, shares: list[int]) -> list[list[int]]:
    """Item indices per process, in order, in proportion to each process's share."""
    out: list[list[int]] = [[] for _ in shares]
    for i in range(num_items):
        out[min(range(len(shares)), key=lambda p: (len(out[p]) / shares[p], p))].append(i)
    return out


async def run_http_cell(
    url: str,
    bodies: list[dict[str, Any]],
    *,
    concurrency: int,
    at_s: list[float] | None,
    num_procs: int,
    timeout_s: float,
) -> tuple[list[Record], dict[str, Any]]:
    """One cell of streaming requests from child processes: the records, and the clients' CPU use."""
    shares = split_concurrency(concurrency if at_s is None else num_procs, num_procs)
    procs: list[asyncio.subprocess.Process] = []
    try:
        for share, idx in zip(shares, assign(len(bodies), shares), strict=True):
            plan = Plan(
                url=url,
                concurrency=share,
                indices=idx,
                bodies=[bodies[i] for i in idx],
                at_s=None if at_s is None else [at_s[i] for i in idx],
                timeout_s=timeout_s,
            )
            proc = await asyncio.create_subprocess_exec(  # as a module of the repo, whatever the cwd
                sys.executable, "-m", "bench.http_client", stdin=-1, stdout=-1, stderr=-1, cwd=_ROOT
            )
            procs.append(proc)
            assert proc.stdin is not None
            proc.stdin.write(msgspec.json.encode(plan) + b"\n")
        for proc in procs:
            assert proc.stdout is not None
            if (await asyncio.wait_for(proc.stdout.readline(), 30.0)).strip() != b"ready":
                _, err = await asyncio.wait_for(proc.communicate(), 10.0)
                raise RuntimeError(f"a client process did not start: {err.decode(errors='replace')[-800:]}")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
        waves = -(-len(bodies) // max(1, concurrency)) if at_s is None else 1
        total_s = max(at_s or [0.0]) + timeout_s * waves + 30.0
        outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), total_s)
    finally:
        for proc in procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), 10.0)
    records: list[Record] = []
    cpu_s, wall_s = [], []
    for proc, (out, err) in zip(procs, outs, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(f"a client process failed: {err.decode(errors='replace')[-800:]}")
        result = msgspec.json.decode(out.strip().splitlines()[-1], type=ChildResult)
        records += result.records
        cpu_s.append(result.cpu_s)
        wall_s.append(result.wall_s)
    busiest = max((c / w for c, w in zip(cpu_s, wall_s, strict=True) if w > 0), default=0.0)
    return records, {"procs": len(procs), "cpu_s": cpu_s, "wall_s": wall_s, "max_utilization": busiest}


if __name__ == "__main__":
    result = asyncio.run(_child(msgspec.json.decode(sys.stdin.readline().encode(), type=Plan)))
    sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
