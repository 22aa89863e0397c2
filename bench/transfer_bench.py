"""CPU transfer benchmark: tcp and shm, each side by side with its baseline, in one run.

For each segment size (4 KiB .. 2 MiB, powers of two) the same 256 MiB are moved as one batch of
segments in a shuffled order on both sides (so nothing coalesces), between this process and a peer
process (spawned):

- tcp   ``agent.read`` / ``agent.write`` against the peer's tcp agent, vs. the raw-socket baseline:
        a ``sendall`` / ``recv_into`` loop over the same segments, between the same two processes,
        on a socket with the same options (TCP_NODELAY, the same buffer sizes), one request byte each;
- shm   ``agent.read`` / ``agent.write`` against the peer's shm region, vs. the copy baseline:
        a numpy slice-copy loop over the same segments between the same two mappings.

Each system runs interleaved with its baseline. 64 sampled segments are checked against the expected
bytes after every read and shm write (tcp and raw-socket writes: by the peer, once their runs are
done). Each point is the median of ``--reps`` runs after a warm-up. Contiguous references (one
256 MiB ``sendall`` and one ``np.copyto``) are reported too. Results go to
``bench/results/transfer_bench.json`` and ``.png``.

    python -m bench.transfer_bench [--quick] [--reps 9] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from moriio_ray import env
from moriio_ray.transfer import (
    MemoryDesc,
    TransferConfig,
    create_agent,
    decode_engine_desc,
    decode_memory_desc,
)
from moriio_ray.transfer.shm_segment import Segment
from moriio_ray.transfer.tcp_client import dial

KiB, MiB = 1 << 10, 1 << 20

from bench.transfer_peer import LOCAL_SEED, PEER_SEED, _peer_main, pattern, raw_recv, raw_send  # noqa: E402


def timed(run: Callable[[], None], check: Callable[[], None], reps: int) -> float:
    """Median seconds of ``reps`` runs (after one warm-up); ``check`` runs after each."""
    return side_by_side((run, check), (lambda: None, lambda: None), reps)[0]


Case = tuple[Callable[[], None], Callable[[], None]]  # (run, check)


def side_by_side(mine: Case, base: Case, reps: int) -> tuple[float, float]:
    """Median seconds of ``reps`` runs of each, interleaved (the order alternates each rep), so that
    a noisy neighbour slows both alike. One warm-up each; each check runs after its run, untimed."""
    cases = [mine, base]
    times: list[list[float]] = [[], []]
    for run, check in cases:
        run()
        check()
    for rep in range(reps):
        for i in (0, 1) if rep % 2 == 0 else (1, 0):
            run, check = cases[i]
            start = time.perf_counter()
            run()
            times[i].append(time.perf_counter() - start)
            check()
    return statistics.median(times[0]), statistics.median(times[1])


class Bench:
    """This process's side: agents, regions, the raw socket and the baseline views."""

    def __init__(self, total_bytes: int) -> None:
        self.total = total_bytes
        buffer_bytes = TransferConfig().tcp.socket_buffer_bytes
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_peer_main, args=(child, total_bytes, env.cluster_token(), buffer_bytes)
        )
        self.proc.start()
        child.close()
        tcp_e, tcp_m, shm_e, shm_m, raw_port = self.conn.recv()
        self.tcp = create_agent(TransferConfig(backend="tcp", timeout_s=120.0), "bench-tcp")
        self.shm = create_agent(TransferConfig(backend="shm", timeout_s=120.0), "bench-shm")
        self.tcp.connect(decode_engine_desc(tcp_e))
        self.shm.connect(decode_engine_desc(shm_e))
        self.tcp_remote, self.shm_remote = decode_memory_desc(tcp_m), decode_memory_desc(shm_m)
        self.tcp_t = self.tcp.allocate((total_bytes,), torch.uint8, "cpu")
        self.shm_t = self.shm.allocate((total_bytes,), torch.uint8, "cpu")
        self.raw_t = torch.empty(total_bytes, dtype=torch.uint8)
        local = torch.from_numpy(pattern(LOCAL_SEED, total_bytes))
        for t in (self.tcp_t, self.shm_t, self.raw_t):
            t.copy_(local)  # also faults every page in before timing
        self.tcp_m, self.shm_m = self.tcp.register(self.tcp_t), self.shm.register(self.shm_t)
        self.raw = dial(("127.0.0.1", raw_port), 10.0, buffer_bytes)
        self.raw.settimeout(None)  # a plain blocking socket, as a hand-written loop would use
        self.peer_view = _peer_array(self.shm_remote)  # the baseline copies from the same mapping
        self.expect_remote = pattern(PEER_SEED, total_bytes)
        self.expect_local = local.numpy()

    def call(self, *msg: Any) -> None:
        self.conn.send(msg)
        answer = self.conn.recv()
        if answer != "ok":
            raise RuntimeError(f"peer: {answer}")

    def close(self) -> None:
        self.call("stop")
        self.proc.join(30)
        self.tcp.close()
        self.shm.close()
        self.raw.close()

    # -- one point ----------------------------------------------------------------------------------

    def point(self, size: int, reps: int) -> dict[str, Any]:
        n = self.total // size
        rng = np.random.default_rng(size)
        lo = rng.permutation(n).astype(np.int64) * size
        ro = rng.permutation(n).astype(np.int64) * size
        sz = np.full(n, size, dtype=np.int64)
        sample = rng.choice(n, min(n, 64), replace=False)
        row: dict[str, Any] = {"segment_bytes": size, "num_segments": n, "total_bytes": self.total}

        def check(local: torch.Tensor, remote: np.ndarray, op: str) -> Callable[[], None]:
            def run() -> None:
                got_local = local.numpy()
                for i in sample.tolist():
                    lo_i, ro_i = int(lo[i]), int(ro[i])
                    if op == "read":
                        ok = np.array_equal(
                            got_local[lo_i : lo_i + size], self.expect_remote[ro_i : ro_i + size]
                        )
                    else:
                        ok = np.array_equal(remote[ro_i : ro_i + size], self.expect_local[lo_i : lo_i + size])
                    assert ok, f"{op} at {size} B: segment {i} holds the wrong bytes"

            return run

        # tcp and its raw-socket baseline; the peer serves 2 * (reps + 1) raw requests meanwhile
        self.call("segments", ro.tobytes(), size)
        self.conn.send(("serve", 2 * (reps + 1)))
        no_check = lambda: None  # writes are checked by the peer, after the timed runs
        tcp_read = lambda: self.tcp.read(self.tcp_m, self.tcp_remote, lo, ro, sz).wait(120)
        tcp_write = lambda: self.tcp.write(self.tcp_m, self.tcp_remote, lo, ro, sz).wait(120)
        row["tcp_read_s"], row["raw_read_s"] = side_by_side(
            (tcp_read, check(self.tcp_t, self.expect_remote, "read")),
            (lambda: self._raw(b"R", lo, size), check(self.raw_t, self.expect_remote, "read")),
            reps,
        )
        self.tcp_t.copy_(torch.from_numpy(self.expect_local))  # writes push the local pattern
        self.raw_t.copy_(torch.from_numpy(self.expect_local))
        row["tcp_write_s"], row["raw_write_s"] = side_by_side(
            (tcp_write, no_check), (lambda: self._raw(b"W", lo, size), no_check), reps
        )
        assert self.conn.recv() == "ok"
        verify = (lo[sample].tobytes(), ro[sample].tobytes(), size)
        self.call("verify", "tcp", *verify)
        self.call("verify", "raw", *verify)
        # shm and its copy baseline
        local = self.shm_t.numpy()
        shm_read = lambda: self.shm.read(self.shm_m, self.shm_remote, lo, ro, sz).wait(120)
        shm_write = lambda: self.shm.write(self.shm_m, self.shm_remote, lo, ro, sz).wait(120)
        np_read = lambda: _np_copy(local, self.peer_view, lo, ro, size)
        np_write = lambda: _np_copy(self.peer_view, local, ro, lo, size)
        read_check = check(self.shm_t, self.expect_remote, "read")
        row["shm_read_s"], row["numpy_read_s"] = side_by_side(
            (shm_read, read_check), (np_read, read_check), reps
        )
        self.shm_t.copy_(torch.from_numpy(self.expect_local))  # writes push the local pattern
        write_check = check(self.shm_t, self.peer_view, "write")
        row["shm_write_s"], row["numpy_write_s"] = side_by_side(
            (shm_write, write_check), (np_write, write_check), reps
        )
        self.peer_view[:] = self.expect_remote  # restore the peer's bytes for the next point
        for name in (
            f"{system}_{op}" for system in ("tcp", "raw", "shm", "numpy") for op in ("read", "write")
        ):
            row[f"{name}_gbps"] = self.total / row[f"{name}_s"] / 1e9
        for mine, base in (("tcp", "raw"), ("shm", "numpy")):
            for op in ("read", "write"):
                row[f"{mine}_{op}_ratio"] = row[f"{base}_{op}_s"] / row[f"{mine}_{op}_s"]
        return row

    def _raw(self, op: bytes, lo: np.ndarray, size: int) -> None:
        """One raw-socket request: b"R" pulls the segments from the peer, b"W" pushes them."""
        view = self.raw_t.numpy().data
        self.raw.sendall(op)
        if op == b"R":
            raw_recv(self.raw, view, lo.tolist(), size)
        else:
            raw_send(self.raw, view, lo.tolist(), size)
            assert self.raw.recv(1) == b"k"

    def contiguous(self, reps: int) -> dict[str, float]:
        """Line-rate references: one contiguous sendall of everything, one np.copyto of everything."""
        one = np.zeros(1, dtype=np.int64)
        self.call("segments", one.tobytes(), self.total)
        self.conn.send(("serve", reps + 1))
        raw_s = timed(lambda: self._raw(b"R", one, self.total), lambda: None, reps)
        assert self.conn.recv() == "ok"
        dst, src = self.shm_t.numpy(), self.peer_view
        copy_s = timed(lambda: np.copyto(dst, src), lambda: None, reps)
        self.shm_t.copy_(torch.from_numpy(self.expect_local))
        return {
            "raw_contiguous_gbps": self.total / raw_s / 1e9,
            "numpy_contiguous_gbps": self.total / copy_s / 1e9,
        }


def _peer_array(mem: MemoryDesc) -> np.ndarray:
    """The peer's shm region, mapped here the same way the shm agent maps it."""
    ref = msgspec.msgpack.decode(mem.backend_data)  # {"name": segment, "offset": bytes}
    seg = Segment.attach(ref["name"], mem.engine_key)
    return seg.data[ref["offset"] : ref["offset"] + mem.num_bytes]


def _np_copy(dst: np.ndarray, src: np.ndarray, d_off: np.ndarray, s_off: np.ndarray, size: int) -> None:
    for d, s in zip(d_off.tolist(), s_off.tolist(), strict=True):
        dst[d : d + size] = src[s : s + size]


# ----------------------------------------------------------------------------------------------
# output


def plot(rows: list[dict[str, Any]], refs: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["segment_bytes"] // KiB for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    panels = (
        ("tcp", "raw", "raw socket", "raw_contiguous_gbps"),
        ("shm", "numpy", "numpy copy", "numpy_contiguous_gbps"),
    )
    for col, (mine, base, base_name, ref) in enumerate(panels):
        ax = axes[0][col]
        for op, style in (("read", "-o"), ("write", "-s")):
            ax.plot(sizes, [r[f"{mine}_{op}_gbps"] for r in rows], style, label=f"{mine} {op}")
            ax.plot(
                sizes, [r[f"{base}_{op}_gbps"] for r in rows], style, alpha=0.5, label=f"{base_name} {op}"
            )
        ax.axhline(refs[ref], color="grey", linestyle="--", label=f"contiguous {base_name}")
        ax.set_ylabel("GB/s")
        ax.set_title(
            f"{mine} vs {base_name} (256 MiB per point)" if rows[0]["total_bytes"] == 256 * MiB else mine
        )
        ax.legend(fontsize=8)
        ratio = axes[1][col]
        for op, style in (("read", "-o"), ("write", "-s")):
            ratio.plot(
                sizes, [r[f"{mine}_{op}_ratio"] for r in rows], style, label=f"{mine} {op} / {base_name}"
            )
        ratio.axhline(0.8, color="red", linestyle=":", label="goal 0.8 (from 64 KiB)")
        ratio.axvline(64, color="red", linestyle=":", alpha=0.3)
        ratio.set_ylabel("ratio to baseline")
        ratio.set_xlabel("segment size (KiB)")
        ratio.legend(fontsize=8)
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--quick", action="store_true", help="8 MiB per point, 4-64 KiB, 1 rep (a smoke test)"
    )
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    total = 8 * MiB if args.quick else 256 * MiB
    sizes = [4 * KiB << i for i in range(5 if args.quick else 10)]
    reps = 1 if args.quick else args.reps
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"transfer_bench: {total // MiB} MiB per point, {len(sizes)} sizes, {reps} reps", flush=True)
    bench = Bench(total)
    try:
        refs = bench.contiguous(reps)
        print(
            f"  contiguous: raw socket {refs['raw_contiguous_gbps']:.2f} GB/s, "
            f"np.copyto {refs['numpy_contiguous_gbps']:.2f} GB/s",
            flush=True,
        )
        rows = []
        for size in sizes:
            row = bench.point(size, reps)
            rows.append(row)
            print(f"  {size // KiB:>5} KiB x {row['num_segments']:>6}: {_summary(row)}", flush=True)
    finally:
        bench.close()
    result = {
        "command": "python -m bench.transfer_bench" + (" --quick" if args.quick else f" --reps {reps}"),
        "total_bytes_per_point": total,
        "reps": reps,
        "statistic": "median seconds per run, after one warm-up run",
        "host": _host(),
        "contiguous": refs,
        "rows": rows,
        "goal": "at 64 KiB and above: tcp >= 0.8 x raw socket, shm >= 0.8 x numpy copy",
        "goal_met": all(
            r[f"{m}_{op}_ratio"] >= 0.8
            for r in rows
            if r["segment_bytes"] >= 64 * KiB
            for m in ("tcp", "shm")
            for op in ("read", "write")
        ),
    }
    name = "transfer_bench_quick" if args.quick else "transfer_bench"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, refs, args.out / f"{name}.png")
    print(f"wrote {args.out / name}.json and .png; goal met: {result['goal_met']}", flush=True)


def _summary(row: dict[str, Any]) -> str:
    """'tcp r/w 2.1/2.0 vs raw 1.9/1.8 GB/s (1.11x/1.11x) | shm ...' for one point."""
    parts = []
    for mine, base in (("tcp", "raw"), ("shm", "numpy")):
        gbps = [f"{row[f'{s}_{op}_gbps']:.2f}" for s in (mine, base) for op in ("read", "write")]
        ratios = [f"{row[f'{mine}_{op}_ratio']:.2f}x" for op in ("read", "write")]
        parts.append(
            f"{mine} r/w {gbps[0]}/{gbps[1]} vs {base} {gbps[2]}/{gbps[3]} GB/s ({'/'.join(ratios)})"
        )
    return " | ".join(parts)


def _host() -> dict[str, Any]:
    import os

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    except OSError:
        model = platform.processor()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)
    return {"cpus": cpus, "cpu_model": model, "python": platform.python_version(), "torch": torch.__version__}


if __name__ == "__main__":
    main(sys.argv[1:])
