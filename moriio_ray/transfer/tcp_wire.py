"""The tcp backend's wire format and its zero-copy socket loops.

Every connection starts with a hello (magic, version, cluster token); the server answers with a
status frame that carries its epoch and key. Then any number of requests, one at a time:

    request:  REQUEST header, then remote offsets and sizes as raw int64 arrays (8 * n bytes each)
    read:     server -> STATUS (ok or error), then the segments' bytes in order
    write:    server -> STATUS (ok or error); client -> the segments' bytes; server -> STATUS

Data never passes through an intermediate bytes object: senders hand memoryviews of the source
to ``sendmsg`` and receivers ``recvmsg_into`` memoryviews of the destination.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

import numpy as np

from moriio_ray.errors import (
    PeerLost,
    SegmentOutOfBounds,
    StaleDescriptor,
    TokenRejected,
    TransferError,
)
from moriio_ray.transfer.plan import batches

MAGIC = b"MRIO"
VERSION = 1
HELLO = struct.Struct("<4sHH")  # magic, version, token length; then the token
REQUEST = struct.Struct("<BxxxIqqq")  # op, segments, mem_id, target epoch, total bytes
_TIMEVAL = struct.Struct("@ll")  # struct timeval for SO_RCVTIMEO / SO_SNDTIMEO
STATUS = struct.Struct("<BxxxIq")  # code, message length, value (epoch in a hello reply); then message

OP_READ = 1
OP_WRITE = 2
OPS = {"read": OP_READ, "write": OP_WRITE}

OK = 0
ERR_TOKEN = 1
ERR_EPOCH = 2
ERR_BOUNDS = 3
ERR_REQUEST = 4
ERR_CLOSING = 5

_ERRORS: dict[int, type[TransferError]] = {
    ERR_TOKEN: TokenRejected,
    ERR_EPOCH: StaleDescriptor,
    ERR_BOUNDS: SegmentOutOfBounds,
    ERR_REQUEST: TransferError,
    ERR_CLOSING: PeerLost,
}

MAX_SEGMENTS = 1 << 24  # a request past this is refused (16 Mi segments = 256 MiB of arrays)
_BATCH_SEGMENTS = 512  # iovecs per sendmsg/recvmsg_into call (below Linux's IOV_MAX of 1024)
_BATCH_BYTES = 8 << 20  # bytes between ticks, so that deadlines and hooks are checked now and then
# Bytes per send call: 1 MiB ran faster on loopback than 256 KiB (more calls, more CPU) and than
# 8 MiB (each chunk falls out of cache between the sender's copy into the kernel and the receiver's).
SEND_CALL_BYTES = 1 << 20
_RECV_INTO_BYTES = 64 << 10  # a first segment this large is received alone, with recv_into


class ConnectionDropped(PeerLost):
    """The peer closed the connection or reset it (EOF or ECONNRESET)."""


def error_for(code: int, message: str) -> TransferError:
    """The typed error a client raises for an error frame from the server."""
    return _ERRORS.get(code, TransferError)(message)


def set_deadline(sock: socket.socket, timeout_s: float | None) -> None:
    """Make ``sock`` blocking with kernel-side timeouts: a send or receive blocked past ``timeout_s``
    fails with EAGAIN (``BlockingIOError``); None waits forever.

    Python's own socket timeouts poll() before every call; these cost nothing per call.
    """
    if sock.gettimeout() is not None:
        sock.settimeout(None)
    if timeout_s is None:
        seconds, micros = 0, 0  # 0 means no timeout
    else:
        timeout_s = max(timeout_s, 1e-3)  # a zero timeval would mean forever
        seconds, micros = int(timeout_s), max(1, int((timeout_s % 1) * 1e6))
    value = _TIMEVAL.pack(seconds, micros)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def status_frame(code: int, message: str = "", value: int = 0) -> bytes:
    data = message.encode()
    return STATUS.pack(code, len(data), value) + data


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket; EOF raises ConnectionDropped."""
    got = 0
    total = len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            raise ConnectionDropped("the peer closed the connection")
        got += n


def recv_status(sock: socket.socket) -> tuple[int, str, int]:
    """One status frame: (code, message, value)."""
    head = bytearray(STATUS.size)
    recv_exact(sock, memoryview(head))
    code, msg_len, value = STATUS.unpack(head)
    message = bytearray(msg_len)
    if msg_len:
        recv_exact(sock, memoryview(message))
    return code, message.decode(errors="replace"), value


def _views(
    base: memoryview, offsets: np.ndarray, sizes: np.ndarray, start: int, stop: int
) -> list[memoryview]:
    return [
        base[o : o + s] for o, s in zip(offsets[start:stop].tolist(), sizes[start:stop].tolist(), strict=True)
    ]


Tick = Callable[[int], None]  # called with the bytes moved so far, between batches


def send_segments(
    sock: socket.socket, base: memoryview, offsets: np.ndarray, sizes: np.ndarray, tick: Tick | None = None
) -> None:
    """Send ``base[offsets[i]:+sizes[i]]`` for all i, in order, with gathered sendmsg calls."""

    def send(bufs: list[memoryview]) -> int:
        # one large segment goes out with send(); sendmsg gathers small ones (it costs more per call)
        if len(bufs) == 1 or len(bufs[0]) >= SEND_CALL_BYTES:
            return sock.send(bufs[0][:SEND_CALL_BYTES])
        return sock.sendmsg(_prefix(bufs, SEND_CALL_BYTES))

    _pump(send, base, offsets, sizes, tick)


def recv_segments(
    sock: socket.socket, base: memoryview, offsets: np.ndarray, sizes: np.ndarray, tick: Tick | None = None
) -> None:
    """Receive into ``base[offsets[i]:+sizes[i]]`` for all i, in order, with scattered recvmsg_into."""

    def receive(bufs: list[memoryview]) -> int:
        # recvmsg_into scatters many small segments per call; a large one is cheaper with recv_into
        if len(bufs) == 1 or len(bufs[0]) >= _RECV_INTO_BYTES:
            got = sock.recv_into(bufs[0])
        else:
            got = sock.recvmsg_into(bufs)[0]
        if got == 0:
            raise ConnectionDropped("the peer closed the connection in the middle of the data")
        return got

    _pump(receive, base, offsets, sizes, tick)


def _pump(
    io: Callable[[list[memoryview]], int],
    base: memoryview,
    offsets: np.ndarray,
    sizes: np.ndarray,
    tick: Tick | None,
) -> None:
    """Move the segments batch by batch with ``io`` (one sendmsg or recvmsg_into per call)."""
    moved = 0
    for start, stop in batches(sizes, _BATCH_SEGMENTS, _BATCH_BYTES):
        bufs = _views(base, offsets, sizes, start, stop)
        while bufs:
            n = io(bufs)
            moved += n
            bufs = _advance(bufs, n)
        if tick is not None:
            tick(moved)


def _prefix(bufs: list[memoryview], limit_bytes: int) -> list[memoryview]:
    """The first ``limit_bytes`` of a list of buffers (the list itself when it holds fewer)."""
    total = 0
    for i, buf in enumerate(bufs):
        total += len(buf)
        if total >= limit_bytes:
            head = bufs[: i + 1]
            head[-1] = buf[: len(buf) - (total - limit_bytes)]
            return head
    return bufs


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first ``n`` bytes from a list of buffers."""
    i = 0
    while i < len(bufs) and n >= len(bufs[i]):
        n -= len(bufs[i])
        i += 1
    rest = bufs[i:]
    if n and rest:
        rest[0] = rest[0][n:]
    return rest


def send_all(sock: socket.socket, bufs: list[memoryview | bytes]) -> None:
    """sendmsg a few buffers (a header and arrays) until all of them are out."""
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        views = _advance(views, sock.sendmsg(views))


def recv_arrays(sock: socket.socket, num_segments: int) -> tuple[np.ndarray, np.ndarray]:
    """The request's offsets and sizes, read straight into one int64 array of shape [2, n]."""
    arrays = np.empty((2, num_segments), dtype=np.int64)
    recv_exact(sock, arrays.data.cast("B"))
    return arrays[0], arrays[1]
