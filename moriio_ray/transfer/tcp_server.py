"""The tcp backend's server: it serves one-sided reads and writes against the agent's regions.

One thread accepts; one thread per connection serves that connection's requests in order. The
server checks every request itself (token, target epoch, region, bounds), whatever the client did.
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
from collections.abc import Callable

import numpy as np

from moriio_ray.config import TcpConfig
from moriio_ray.errors import SegmentOutOfBounds, TransferError
from moriio_ray.transfer.plan import check_bounds
from moriio_ray.transfer.tcp_region import Region
from moriio_ray.transfer.tcp_wire import (
    ERR_BOUNDS,
    ERR_EPOCH,
    ERR_REQUEST,
    ERR_TOKEN,
    HELLO,
    MAGIC,
    MAX_SEGMENTS,
    OK,
    OP_READ,
    OP_WRITE,
    REQUEST,
    VERSION,
    recv_arrays,
    recv_exact,
    set_deadline,
    status_frame,
)

log = logging.getLogger(__name__)

_JOIN_S = 2.0  # how long close() waits for each thread
_MAX_TOKEN_BYTES = 4096


def tune(sock: socket.socket, buffer_bytes: int) -> None:
    """Options shared by both ends: no Nagle delay on small frames, large socket buffers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


class _Refused(Exception):
    """A request the server refuses with an error frame; the connection stays usable."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class TcpServer:
    """Listens on ``config.bind_host:config.port`` (0: an ephemeral port) and serves requests."""

    def __init__(
        self,
        key: str,
        epoch: int,
        token: bytes,
        config: TcpConfig,
        timeout_s: float,
        lookup: Callable[[int], Region | None],
    ) -> None:
        self.key, self.epoch, self._token = key, epoch, token
        self._config, self._timeout_s, self._lookup = config, timeout_s, lookup
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._listener = socket.create_server((config.bind_host, config.port), backlog=128)
        tune(self._listener, config.socket_buffer_bytes)  # accepted connections inherit the sizes
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"tcp-accept-{key}", daemon=True)
        self._acceptor.start()

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop accepting, drop every connection (clients see EOF) and join the threads."""
        self._closing.set()
        _shutdown(self._listener)
        self._listener.close()
        with self._lock:
            conns = dict(self._conns)
        for conn in conns:
            _shutdown(conn)
        self._acceptor.join(_JOIN_S)
        for thread in conns.values():
            thread.join(_JOIN_S)

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # the listener was shut down by close()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(
                target=self._serve, args=(conn,), name=f"tcp-serve-{self.key}", daemon=True
            )
            with self._lock:
                if self._closing.is_set():
                    conn.close()
                    return
                self._conns[conn] = thread
            thread.start()

    # -- one connection -------------------------------------------------------------------------

    def _serve(self, conn: socket.socket) -> None:
        try:
            set_deadline(conn, self._timeout_s)
            if not self._hello(conn):
                return
            head = bytearray(REQUEST.size)
            while not self._closing.is_set():
                set_deadline(conn, None)  # an idle pooled connection waits for its next request
                recv_exact(conn, memoryview(head)[:1])
                set_deadline(conn, self._timeout_s)
                recv_exact(conn, memoryview(head)[1:])
                self._request(conn, *REQUEST.unpack(head))
        except (OSError, TransferError) as exc:
            # EOF, reset or a timeout: the client went away or stalled; its side reports the failure
            log.debug("tcp server %s: connection ended: %s", self.key, exc)
        except Exception:
            # a bug, not the peer: log it; the client sees the connection close and reports PeerLost
            log.exception("tcp server %s: request failed", self.key)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _hello(self, conn: socket.socket) -> bool:
        head = bytearray(HELLO.size)
        recv_exact(conn, memoryview(head))
        magic, version, token_len = HELLO.unpack(head)
        if magic != MAGIC or version != VERSION or token_len > _MAX_TOKEN_BYTES:
            conn.sendall(status_frame(ERR_REQUEST, f"{self.key!r} speaks tcp wire version {VERSION}"))
            return False
        token = bytearray(token_len)
        recv_exact(conn, memoryview(token))
        if not hmac.compare_digest(bytes(token), self._token):
            conn.sendall(
                status_frame(
                    ERR_TOKEN,
                    f"peer {self.key!r} refused the cluster token; every engine must get the same "
                    "token from the coordinator (or MORIIO_RAY_CLUSTER_TOKEN)",
                )
            )
            return False
        conn.sendall(status_frame(OK, self.key, self.epoch))
        return True

    def _request(self, conn: socket.socket, op: int, n: int, mem_id: int, epoch: int, total: int) -> None:
        if n > MAX_SEGMENTS:
            conn.sendall(status_frame(ERR_REQUEST, f"{n} segments exceed the limit of {MAX_SEGMENTS}"))
            raise _closed("request too large")  # the arrays that follow cannot be skipped cheaply
        offsets, sizes = recv_arrays(conn, n)
        try:
            region = self._check(op, n, mem_id, epoch, total, offsets, sizes)
        except _Refused as refused:
            conn.sendall(status_frame(refused.code, str(refused)))
            return
        conn.sendall(status_frame(OK))
        if op == OP_READ:
            region.send(conn, offsets, sizes, self._tick)
        else:
            region.recv(conn, offsets, sizes, self._tick)
            conn.sendall(status_frame(OK))  # the data is in place (and on the device) before this

    def _check(
        self, op: int, n: int, mem_id: int, epoch: int, total: int, offsets: np.ndarray, sizes: np.ndarray
    ) -> Region:
        if op not in (OP_READ, OP_WRITE):
            raise _Refused(ERR_REQUEST, f"unknown op {op}")
        if epoch != self.epoch:
            raise _Refused(
                ERR_EPOCH,
                f"peer {self.key!r} runs epoch {self.epoch}, the request targets epoch {epoch}; "
                "fetch fresh descriptors from the coordinator",
            )
        region = self._lookup(mem_id)
        if region is None:
            raise _Refused(
                ERR_REQUEST, f"region {mem_id} of {self.key!r} is not registered (or was deregistered)"
            )
        try:
            check_bounds(offsets, sizes, region.num_bytes, "remote", f"region {mem_id} of {self.key!r}")
        except SegmentOutOfBounds as exc:
            raise _Refused(ERR_BOUNDS, f"{exc}, refused by the peer's server") from None
        if n and int(sizes.sum()) != total:
            raise _Refused(ERR_REQUEST, f"total bytes {total} differ from the sum of the sizes")
        return region

    def _tick(self, moved_bytes: int) -> None:
        if self._closing.is_set():
            raise _closed("server closing")
        self._on_moved(moved_bytes)
        if self._closing.is_set():
            raise _closed("server closed mid-request")

    def _on_moved(self, moved_bytes: int) -> None:
        """Called as a request's data moves (a no-op here; a subclass may observe or pace it)."""


def _closed(why: str) -> OSError:
    return ConnectionAbortedError(why)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed or never connected
