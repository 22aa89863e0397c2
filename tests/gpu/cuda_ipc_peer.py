"""Helpers for the cuda_ipc tests: byte patterns, random segment sets, and a peer in a child process.

The child (``serve``) is a real cuda_ipc agent in another process: it allocates and registers a
region on its GPU, fills it with a known pattern, sends its descriptors and answers commands.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import Any

import numpy as np


def pattern(num_bytes: int, seed: int) -> np.ndarray:
    """Deterministic random bytes (never zeros, which hide unwritten output)."""
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)


def random_segments(
    rng: np.random.Generator, count: int, dst_bytes: int, src_bytes: int, max_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``count`` segments of 1..max_size bytes at arbitrary (unaligned) offsets, in random order.

    Destinations never overlap (gaps of 0..64 bytes between them); sources may.
    Returns (dst_offsets, src_offsets, sizes).
    """
    sizes = rng.integers(1, max_size + 1, count)
    # a few large pieces and some exact multiples of 16 too, so every code path of the kernel runs
    sizes[: count // 10] = rng.integers(1, 8, count // 10) * 4096 + rng.integers(0, 16, count // 10)
    sizes[count // 10 : count // 5] = rng.integers(1, 64, count // 10) * 16
    gaps = rng.integers(0, 65, count)
    starts = np.cumsum(gaps + sizes) - sizes
    assert int(starts[-1] + sizes[-1]) <= dst_bytes, "dst region too small for these segments"
    order = rng.permutation(count)
    dst = starts[order].astype(np.int64)
    size = sizes[order].astype(np.int64)
    src = (rng.integers(0, src_bytes, count) % (src_bytes - size + 1)).astype(np.int64)
    return dst, src, size


def apply(
    dst: np.ndarray, src: np.ndarray, dst_off: np.ndarray, src_off: np.ndarray, sizes: np.ndarray
) -> None:
    """The reference copy, on the CPU."""
    for d, s, n in zip(dst_off.tolist(), src_off.tolist(), sizes.tolist(), strict=True):
        dst[d : d + n] = src[s : s + n]


def serve(conn: Connection, key: str, device_index: int, num_bytes: int, seed: int) -> None:
    """Child process: a cuda_ipc agent holding one registered region filled with ``pattern``."""
    import torch

    from moriio_ray.transfer import TransferConfig, create_agent

    torch.cuda.set_device(device_index)
    agent = create_agent(TransferConfig(backend="cuda_ipc"), key)
    region = agent.allocate((num_bytes,), torch.uint8, f"cuda:{device_index}")
    region.copy_(torch.from_numpy(pattern(num_bytes, seed)))
    torch.cuda.synchronize()
    mem = agent.register(region)
    conn.send((agent.engine_desc(), mem))
    while True:
        cmd = conn.recv()
        if cmd == "dump":
            torch.cuda.synchronize()
            conn.send(region.cpu().numpy())
        elif cmd == "stop":
            break
    agent.close()


class Peer:
    """A ``serve`` child process and its descriptors."""

    def __init__(self, key: str, device_index: int, num_bytes: int, seed: int) -> None:
        ctx = mp.get_context("spawn")  # CUDA does not survive fork
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, key, device_index, num_bytes, seed), daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            self.proc.kill()
            raise RuntimeError(f"peer {key} did not start within 120 s")
        self.desc, self.mem = self.conn.recv()

    def dump(self) -> Any:
        self.conn.send("dump")
        if not self.conn.poll(60):
            raise RuntimeError("peer did not answer 'dump' within 60 s")
        return self.conn.recv()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(30)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send("stop")
            self.proc.join(30)
        if self.proc.is_alive():
            self.kill()
