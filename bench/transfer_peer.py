"""The peer process of ``transfer_bench.py``: it owns the remote regions (a tcp agent, a shm region
and a raw socket) and serves the baseline's socket loop, until told to stop."""

from __future__ import annotations

import socket
from multiprocessing.connection import Connection

import numpy as np
import torch

from moriio_ray.transfer import (
    TransferConfig,
    create_agent,
    encode_desc,
)
from moriio_ray.transfer.tcp_server import tune

KiB, MiB = 1 << 10, 1 << 20
PEER_SEED = 1
LOCAL_SEED = 2


def pattern(seed: int, num_bytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)


# ----------------------------------------------------------------------------------------------
# raw-socket baseline loops (the plainest way to move the same segments)


def raw_send(sock: socket.socket, view: memoryview, offsets: list[int], size: int) -> None:
    for off in offsets:
        sock.sendall(view[off : off + size])


def raw_recv(sock: socket.socket, view: memoryview, offsets: list[int], size: int) -> None:
    for off in offsets:
        got = 0
        while got < size:
            n = sock.recv_into(view[off + got : off + size], size - got)
            if n == 0:
                raise ConnectionError("raw baseline: the peer closed the socket")
            got += n


# ----------------------------------------------------------------------------------------------
# the peer process


def _peer_main(conn: Connection, total_bytes: int, token: bytes, buffer_bytes: int) -> None:
    tcp = create_agent(TransferConfig(backend="tcp", timeout_s=120.0), "bench-peer-tcp", token=token)
    shm = create_agent(TransferConfig(backend="shm", timeout_s=120.0), "bench-peer-shm", token=token)
    data = torch.from_numpy(pattern(PEER_SEED, total_bytes))
    tcp_t = tcp.allocate((total_bytes,), torch.uint8, "cpu")
    shm_t = shm.allocate((total_bytes,), torch.uint8, "cpu")
    raw_t = torch.empty(total_bytes, dtype=torch.uint8)
    for t in (tcp_t, shm_t, raw_t):
        t.copy_(data)
    tcp_m, shm_m = tcp.register(tcp_t), shm.register(shm_t)
    listener = socket.create_server(("127.0.0.1", 0))
    tune(listener, buffer_bytes)
    conn.send(
        (
            encode_desc(tcp.engine_desc()),
            encode_desc(tcp_m),
            encode_desc(shm.engine_desc()),
            encode_desc(shm_m),
            listener.getsockname()[1],
        )
    )
    raw, _ = listener.accept()
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = raw_t.numpy().data
    regions = {"tcp": tcp_t.numpy(), "raw": raw_t.numpy()}
    expect_local = pattern(LOCAL_SEED, total_bytes)
    offsets: list[int] = []
    size = 0
    while True:
        msg = conn.recv()
        if msg[0] == "segments":  # the raw baseline's segment list for the next runs (not timed)
            offsets, size = np.frombuffer(msg[1], dtype=np.int64).tolist(), msg[2]
            conn.send("ok")
        elif msg[0] == "serve":  # serve msg[1] raw requests: b"R" = send segments, b"W" = receive + ack
            for _ in range(msg[1]):
                op = raw.recv(1)
                if op == b"R":
                    raw_send(raw, view, offsets, size)
                else:
                    raw_recv(raw, view, offsets, size)
                    raw.sendall(b"k")
            conn.send("ok")
        elif msg[0] == "verify":  # sampled segments hold what the writes pushed; then restore
            region = regions[msg[1]]
            lo, ro, size_ = (np.frombuffer(msg[2], np.int64), np.frombuffer(msg[3], np.int64), msg[4])
            bad = [
                i
                for i, (lo_i, ro_i) in enumerate(zip(lo.tolist(), ro.tolist(), strict=True))
                if not np.array_equal(region[ro_i : ro_i + size_], expect_local[lo_i : lo_i + size_])
            ]
            region[:] = data.numpy()
            conn.send("ok" if not bad else f"{msg[1]} write at {size_} B: sampled segments {bad} are wrong")
        elif msg[0] == "stop":
            break
    raw.close()
    tcp.close()
    shm.close()
    conn.send("ok")


# ----------------------------------------------------------------------------------------------
# measurement
