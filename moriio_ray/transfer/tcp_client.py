"""The tcp backend's client side: a pool of connections per peer and the worker threads that use it.

A peer's pool opens at most ``max_conns`` connections, each with one hello (the cluster token), and
reuses them for every later request. ``close(reason)`` fails the peer's in-flight transfers with
``reason`` and shuts its sockets down, so that a worker blocked on one returns at once.
"""

from __future__ import annotations

import socket
import threading
import time

from moriio_ray.config import TcpConfig
from moriio_ray.errors import IncompatiblePeer, PeerLost, StaleDescriptor, TransferTimeout
from moriio_ray.transfer.desc import EngineDesc
from moriio_ray.transfer.handle import FutureTransfer
from moriio_ray.transfer.tcp_server import tune
from moriio_ray.transfer.tcp_wire import HELLO, MAGIC, OK, VERSION, error_for, recv_status, send_all


def dial(address: tuple[str, int], timeout_s: float, buffer_bytes: int) -> socket.socket:
    """Connect with the buffer sizes set before the handshake (they fix TCP's window scale)."""
    error: OSError = OSError(f"no address for {address}")
    for family, kind, proto, _, addr in socket.getaddrinfo(*address, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            tune(sock, buffer_bytes)
            sock.settimeout(timeout_s)
            sock.connect(addr)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    raise error


class PeerPool:
    """Connections to one peer (one epoch of it), opened lazily and reused."""

    def __init__(
        self, desc: EngineDesc, address: tuple[str, int], token: bytes, config: TcpConfig, max_conns: int
    ) -> None:
        self.desc, self.address, self._token = desc, address, token
        self._config, self._max_conns = config, max_conns
        self._cond = threading.Condition()
        self._idle: list[socket.socket] = []
        self._open: set[socket.socket] = set()
        self._inflight: set[FutureTransfer] = set()
        self.error: PeerLost | None = None

    def open(self) -> socket.socket:
        """A new connection that has passed the hello (token and epoch)."""
        try:
            sock = dial(self.address, self._config.connect_timeout_s, self._config.socket_buffer_bytes)
        except OSError as exc:
            raise PeerLost(f"peer {self.desc.key!r} at {self.address}: cannot connect: {exc}") from None
        try:
            send_all(sock, [HELLO.pack(MAGIC, VERSION, len(self._token)), self._token])
            code, message, epoch = recv_status(sock)
        except OSError as exc:
            sock.close()
            raise PeerLost(f"peer {self.desc.key!r} at {self.address}: hello failed: {exc}") from None
        except BaseException:
            sock.close()
            raise
        if code == OK and message == self.desc.key and epoch == self.desc.epoch:
            return sock
        sock.close()
        if code != OK:
            raise error_for(code, message)
        if message != self.desc.key:
            raise IncompatiblePeer(
                f"{self.address} serves engine {message!r}, not {self.desc.key!r}; fetch a fresh descriptor"
            )
        raise StaleDescriptor(
            f"peer {self.desc.key!r} runs epoch {epoch}, the descriptor says epoch {self.desc.epoch}; "
            "fetch a fresh descriptor from the coordinator"
        )

    def add(self, sock: socket.socket) -> None:
        """Keep an opened connection for reuse."""
        with self._cond:
            self._open.add(sock)
            self._idle.append(sock)
            self._cond.notify()

    def acquire(self, deadline_s: float) -> socket.socket:
        """An idle connection, or a new one while below ``max_conns``; waits until the deadline."""
        with self._cond:
            while True:
                if self.error is not None:
                    raise self.error
                if self._idle:
                    return self._idle.pop()
                if len(self._open) < self._max_conns:
                    break
                left = deadline_s - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    raise TransferTimeout(f"no connection to peer {self.desc.key!r} became free in time")
        sock = self.open()  # outside the lock: it waits on the network
        with self._cond:
            if self.error is not None:
                sock.close()
                raise self.error
            self._open.add(sock)
        return sock

    def release(self, sock: socket.socket, healthy: bool) -> None:
        """Return a connection; an unhealthy one (its stream state is unknown) is closed."""
        with self._cond:
            if healthy and self.error is None:
                self._idle.append(sock)
            else:
                self._open.discard(sock)
                sock.close()
            self._cond.notify()

    def track(self, transfer: FutureTransfer) -> None:
        with self._cond:
            if self.error is not None:
                transfer.set_error(self.error)
            self._inflight.add(transfer)

    def untrack(self, transfer: FutureTransfer) -> None:
        with self._cond:
            self._inflight.discard(transfer)

    def close(self, reason: PeerLost) -> None:
        """Fail in-flight transfers with ``reason`` and shut every connection down."""
        with self._cond:
            self.error = reason
            inflight, self._inflight = self._inflight, set()
            idle, self._idle = self._idle, []
            self._open.difference_update(idle)
            busy = set(self._open)  # a worker holds these; it closes them when its recv fails
            self._cond.notify_all()
        for transfer in inflight:
            transfer.set_error(reason)
        for sock in idle:
            sock.close()
        for sock in busy:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already gone
