"""CPU transfer benchmark: tcp and shm, each beside its baseline, in one run.

For each segment size (4 KiB .. 2 MiB) the same 256 MiB move as one batch of segments in a shuffled
order on both sides (nothing coalesces), between this process and a spawned peer:
- tcp: ``read`` / ``write`` against the peer's tcp agent, against a raw ``sendall`` / ``recv_into``
  loop over the same segments on a socket with the same options;
- shm: ``read`` / ``write`` against the peer's region, against a numpy slice-copy loop between the
  same two mappings.
Each system runs interleaved with its baseline (the order alternating each rep), median of --reps
after a warm-up; 64 sampled segments are checked after every read and write. Contiguous references
(one 256 MiB ``sendall``, one ``np.copyto``) too.

    python -m bench.transfer_bench [--quick] [--reps 9] [--out bench/results]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from bench.common import RESULTS, agent_op, load_goals, median, pyplot, run_record, save, write_json
from moriio_ray import env
from moriio_ray.transfer import (
    TransferConfig,
    create_agent,
    decode_engine_desc,
    decode_memory_desc,
    encode_desc,
)

KiB, MiB = 1 << 10, 1 << 20
PEER_SEED, LOCAL_SEED = 1, 2
Case = tuple[Callable[[], None], Callable[[], None]]  # (run, check)


def pattern(seed: int, num_bytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)


def raw_send(sock: socket.socket, view: memoryview, offsets: list[int], size: int) -> None:
    for off in offsets:
        sock.sendall(view[off : off + size])


def raw_recv(sock: socket.socket, view: memoryview, offsets: list[int], size: int) -> None:
    for off in offsets:
        got = 0
        while got < size:
            if (n := sock.recv_into(view[off + got : off + size], size - got)) == 0:
                raise ConnectionError("raw baseline: the peer closed the socket")
            got += n


def agents(
    token: bytes | None, name: str, total: int, seed: int
) -> tuple[Any, Any, list[torch.Tensor], list[Any]]:
    """A tcp and a shm agent, each with a registered region of ``total`` bytes of ``pattern(seed)``,
    and a plain tensor of the same bytes (the raw baseline's)."""
    made = [
        create_agent(TransferConfig(backend=b, timeout_s=120.0), f"{name}-{b}", token=token)
        for b in ("tcp", "shm")
    ]
    data = torch.from_numpy(pattern(seed, total))
    tensors = [agent.allocate((total,), torch.uint8, "cpu") for agent in made] + [
        torch.empty(total, dtype=torch.uint8)
    ]
    for t in tensors:
        t.copy_(data)  # also faults every page in before timing
    return made[0], made[1], tensors, [agent.register(t) for agent, t in zip(made, tensors, strict=False)]


def peer_main(conn: Connection, total: int, token: bytes, buffer_bytes: int) -> None:
    """The peer: owns the remote regions and serves the raw socket loop, until told to stop."""
    from moriio_ray.transfer.tcp_server import tune

    tcp, shm, (tcp_t, _, raw_t), mems = agents(token, "bench-peer", total, PEER_SEED)
    listener = socket.create_server(("127.0.0.1", 0))
    tune(listener, buffer_bytes)
    conn.send(
        [encode_desc(x) for x in (tcp.engine_desc(), mems[0], shm.engine_desc(), mems[1])]
        + [listener.getsockname()[1]]
    )
    raw, _ = listener.accept()
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view, regions, expect = (
        raw_t.numpy().data,
        {"tcp": tcp_t.numpy(), "raw": raw_t.numpy()},
        pattern(LOCAL_SEED, total),
    )
    offsets, size = list[int](), 0
    while (msg := conn.recv())[0] != "stop":
        if msg[0] == "segments":  # the raw baseline's segments for the next runs (not timed)
            offsets, size = np.frombuffer(msg[1], dtype=np.int64).tolist(), msg[2]
        elif msg[0] == "serve":  # msg[1] raw requests: b"R" sends the segments, b"W" receives them and acks
            for _ in range(msg[1]):
                if raw.recv(1) == b"R":
                    raw_send(raw, view, offsets, size)
                else:
                    raw_recv(raw, view, offsets, size)
                    raw.sendall(b"k")
        elif msg[0] == "verify":  # sampled segments hold what the writes pushed; then restore
            region, lo, ro, n = (
                regions[msg[1]],
                np.frombuffer(msg[2], np.int64),
                np.frombuffer(msg[3], np.int64),
                msg[4],
            )
            bad = [
                i
                for i, (a, b) in enumerate(zip(lo.tolist(), ro.tolist(), strict=True))
                if not np.array_equal(region[b : b + n], expect[a : a + n])
            ]
            region[:] = pattern(PEER_SEED, total)
            conn.send("ok" if not bad else f"{msg[1]} write at {n} B: sampled segments {bad} are wrong")
            continue
        conn.send("ok")
    for x in (raw, tcp, shm):
        x.close()
    conn.send("ok")


def side_by_side(mine: Case, base: Case, reps: int) -> tuple[float, float]:
    """Median seconds of ``reps`` runs of each, interleaved (the order alternating each rep); one
    warm-up each; each check runs after its run, untimed."""
    cases, times = [mine, base], [list[float](), list[float]()]
    for run, check in cases:
        run()
        check()
    for rep in range(reps):
        for i in (0, 1) if rep % 2 == 0 else (1, 0):
            start = time.perf_counter()
            cases[i][0]()
            times[i].append(time.perf_counter() - start)
            cases[i][1]()
    return median(times[0]), median(times[1])


class Bench:
    """This process's side: agents, regions, the raw socket and the baseline views."""

    def __init__(self, total: int) -> None:
        from moriio_ray.transfer.shm_segment import Segment
        from moriio_ray.transfer.tcp_client import dial

        self.total, buffer_bytes = total, TransferConfig().tcp.socket_buffer_bytes
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=peer_main, args=(child, total, env.cluster_token(), buffer_bytes))
        self.proc.start()
        child.close()
        tcp_e, tcp_m, shm_e, shm_m, raw_port = self.conn.recv()
        self.tcp, self.shm, (self.tcp_t, self.shm_t, self.raw_t), (self.tcp_m, self.shm_m) = agents(
            None, "bench", total, LOCAL_SEED
        )
        self.tcp.connect(decode_engine_desc(tcp_e))
        self.shm.connect(decode_engine_desc(shm_e))
        self.tcp_remote, self.shm_remote = decode_memory_desc(tcp_m), decode_memory_desc(shm_m)
        self.raw = dial(("127.0.0.1", raw_port), 10.0, buffer_bytes)
        self.raw.settimeout(None)  # a plain blocking socket, as a hand-written loop would use
        ref = msgspec.msgpack.decode(
            self.shm_remote.backend_data
        )  # the peer's region, mapped as the agent maps it
        seg = Segment.attach(ref["name"], self.shm_remote.engine_key)
        self.peer_view = seg.data[ref["offset"] : ref["offset"] + self.shm_remote.num_bytes]
        self.expect_remote, self.expect_local = pattern(PEER_SEED, total), pattern(LOCAL_SEED, total)

    def call(self, *msg: Any) -> None:
        self.conn.send(msg)
        if (answer := self.conn.recv()) != "ok":
            raise RuntimeError(f"peer: {answer}")

    def close(self) -> None:
        self.call("stop")
        self.proc.join(30)
        for x in (self.tcp, self.shm, self.raw):
            x.close()

    def _raw(self, op: bytes, lo: np.ndarray, size: int) -> None:
        """One raw-socket request: b"R" pulls the segments from the peer, b"W" pushes them."""
        self.raw.sendall(op)
        (raw_recv if op == b"R" else raw_send)(self.raw, self.raw_t.numpy().data, lo.tolist(), size)
        assert op == b"R" or self.raw.recv(1) == b"k"

    def point(self, size: int, reps: int) -> dict[str, Any]:
        n = self.total // size
        rng = np.random.default_rng(size)
        lo, ro = rng.permutation(n).astype(np.int64) * size, rng.permutation(n).astype(np.int64) * size
        sz, sample = np.full(n, size, dtype=np.int64), rng.choice(n, min(n, 64), replace=False).tolist()
        row: dict[str, Any] = {"segment_bytes": size, "num_segments": n, "total_bytes": self.total}

        def check(got: np.ndarray, want: np.ndarray, read: bool) -> Callable[[], None]:
            def run() -> None:
                for i in sample:
                    a, b = (int(lo[i]), int(ro[i])) if read else (int(ro[i]), int(lo[i]))
                    assert np.array_equal(got[a : a + size], want[b : b + size]), (
                        f"{size} B: segment {i} is wrong"
                    )

            return run

        def agent(name: str, op: str) -> Callable[[], None]:
            mem, remote = (self.tcp_m, self.tcp_remote) if name == "tcp" else (self.shm_m, self.shm_remote)
            return lambda: agent_op(getattr(self, name), op, mem, remote, lo, ro, sz).wait(120)

        def copy(
            dst: np.ndarray, src: np.ndarray, d_off: np.ndarray, s_off: np.ndarray
        ) -> Callable[[], None]:
            def run() -> None:
                for d, s in zip(d_off.tolist(), s_off.tolist(), strict=True):
                    dst[d : d + size] = src[s : s + size]

            return run

        none = lambda: None  # tcp and raw-socket writes are checked by the peer, after the timed runs
        self.call("segments", ro.tobytes(), size)
        self.conn.send(("serve", 2 * (reps + 1)))  # the peer serves the raw requests meanwhile
        read_tcp = check(self.tcp_t.numpy(), self.expect_remote, True)
        read_raw = check(self.raw_t.numpy(), self.expect_remote, True)
        row["tcp_read_s"], row["raw_read_s"] = side_by_side(
            (agent("tcp", "read"), read_tcp), (lambda: self._raw(b"R", lo, size), read_raw), reps
        )
        for t in (self.tcp_t, self.raw_t):
            t.copy_(torch.from_numpy(self.expect_local))  # writes push the local pattern
        row["tcp_write_s"], row["raw_write_s"] = side_by_side(
            (agent("tcp", "write"), none), (lambda: self._raw(b"W", lo, size), none), reps
        )
        assert self.conn.recv() == "ok"
        for name in ("tcp", "raw"):
            self.call("verify", name, lo[sample].tobytes(), ro[sample].tobytes(), size)
        local = self.shm_t.numpy()
        read_check = check(local, self.expect_remote, True)
        row["shm_read_s"], row["numpy_read_s"] = side_by_side(
            (agent("shm", "read"), read_check), (copy(local, self.peer_view, lo, ro), read_check), reps
        )
        self.shm_t.copy_(torch.from_numpy(self.expect_local))
        write_check = check(self.peer_view, self.expect_local, False)
        row["shm_write_s"], row["numpy_write_s"] = side_by_side(
            (agent("shm", "write"), write_check), (copy(self.peer_view, local, ro, lo), write_check), reps
        )
        self.peer_view[:] = self.expect_remote  # the peer's bytes back for the next point
        for mine, base in (("tcp", "raw"), ("shm", "numpy")):
            for op in ("read", "write"):
                for s in (mine, base):
                    row[f"{s}_{op}_gbps"] = self.total / row[f"{s}_{op}_s"] / 1e9
                row[f"{mine}_{op}_ratio"] = row[f"{base}_{op}_s"] / row[f"{mine}_{op}_s"]
        return row

    def contiguous(self, reps: int) -> dict[str, float]:
        """Line-rate references: one sendall of everything, one np.copyto of everything."""
        one = np.zeros(1, dtype=np.int64)
        self.call("segments", one.tobytes(), self.total)
        self.conn.send(("serve", reps + 1))
        none = (lambda: None, lambda: None)
        raw_s, _ = side_by_side((lambda: self._raw(b"R", one, self.total), none[1]), none, reps)
        assert self.conn.recv() == "ok"
        dst = self.shm_t.numpy()
        copy_s, _ = side_by_side((lambda: np.copyto(dst, self.peer_view), none[1]), none, reps)
        self.shm_t.copy_(torch.from_numpy(self.expect_local))
        return {
            "raw_contiguous_gbps": self.total / raw_s / 1e9,
            "numpy_contiguous_gbps": self.total / copy_s / 1e9,
        }


def plot(rows: list[dict[str, Any]], refs: dict[str, float], goal: float, path: Path) -> None:
    sizes = [r["segment_bytes"] // KiB for r in rows]
    fig, axes = pyplot().subplots(2, 2, figsize=(12, 8), sharex=True)
    for col, (mine, base, ref) in enumerate(
        (("tcp", "raw", "raw_contiguous_gbps"), ("shm", "numpy", "numpy_contiguous_gbps"))
    ):
        for op, style in (("read", "-o"), ("write", "-s")):
            axes[0][col].plot(sizes, [r[f"{mine}_{op}_gbps"] for r in rows], style, label=f"{mine} {op}")
            axes[0][col].plot(
                sizes, [r[f"{base}_{op}_gbps"] for r in rows], style, alpha=0.5, label=f"{base} {op}"
            )
            axes[1][col].plot(
                sizes, [r[f"{mine}_{op}_ratio"] for r in rows], style, label=f"{mine} {op} / {base}"
            )
        axes[0][col].axhline(refs[ref], color="grey", linestyle="--", label=f"contiguous {base}")
        axes[0][col].set(
            ylabel="GB/s", title=f"{mine} against {base} ({rows[0]['total_bytes'] // MiB} MiB per point)"
        )
        axes[1][col].axhline(goal, color="red", linestyle=":", label=f"goal {goal}")
        axes[1][col].set(ylabel="ratio to baseline", xlabel="segment size (KiB)")
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    save(fig, path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="8 MiB per point, 4-64 KiB, 1 rep (a smoke test)")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--out", type=Path, default=RESULTS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    total = 8 * MiB if args.quick else 256 * MiB
    sizes, reps = [4 * KiB << i for i in range(5 if args.quick else 10)], 1 if args.quick else args.reps
    goal = load_goals("transfer_cpu")
    result = run_record(
        "python -m bench.transfer_bench" + (" --quick" if args.quick else f" --reps {reps}"), vars(args)
    )
    print(f"transfer_bench: {total // MiB} MiB per point, {len(sizes)} sizes, {reps} reps", flush=True)
    bench = Bench(total)
    try:
        refs = bench.contiguous(reps)
        print(f"  contiguous GB/s: {refs}", flush=True)
        rows = []
        for size in sizes:
            rows.append(row := bench.point(size, reps))
            print(
                f"  {size // KiB:>5} KiB x {row['num_segments']:>6}: "
                + " | ".join(
                    f"{m} r/w {row[f'{m}_read_gbps']:.2f}/{row[f'{m}_write_gbps']:.2f} GB/s "
                    f"({row[f'{m}_read_ratio']:.2f}x/{row[f'{m}_write_ratio']:.2f}x)"
                    for m in ("tcp", "shm")
                ),
                flush=True,
            )
    finally:
        bench.close()
    result |= {
        "total_bytes_per_point": total,
        "reps": reps,
        "statistic": "median seconds per run, after one warm-up",
        "contiguous": refs,
        "rows": rows,
        "goal": f">= {goal['ratio_at_least']} x the baseline from {goal['from_segment_bytes'] // KiB} KiB",
    }
    result["goal_met"] = all(
        r[f"{m}_{op}_ratio"] >= goal["ratio_at_least"]
        for r in rows
        if r["segment_bytes"] >= goal["from_segment_bytes"]
        for m in ("tcp", "shm")
        for op in ("read", "write")
    )
    name = "transfer_bench_quick" if args.quick else "transfer_bench"
    write_json(args.out / f"{name}.json", result)
    plot(rows, refs, goal["ratio_at_least"], args.out / f"{name}.png")
    print(f"wrote {args.out / name}.json and .png; goal met: {result['goal_met']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
