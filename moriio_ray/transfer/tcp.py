"""Backend ``tcp``: one-sided reads and writes over TCP, between any two hosts.

Each agent runs a server (``tcp_server.py``) against its own registered regions; peers reach it
through the host and port in its ``EngineDesc``. A read or write is one request carrying the whole
batch of segments, issued on a client thread over a pooled connection (``tcp_client.py``),
so ``read``/``write`` return a ``Transfer`` at once. Both ends move bytes straight between the
socket and the tensors (``tcp_wire.py``); GPU tensors go through pinned staging (``tcp_region.py``).

Failures: a peer that closes or dies gives ``PeerLost`` (EOF or reset on the socket); a peer that
stalls past ``config.timeout_s`` gives ``TransferTimeout`` and its connection is dropped.
"""

from __future__ import annotations

import socket
import time
from typing import Any, ClassVar

import msgspec
import torch

from moriio_ray.errors import ConfigError, PeerLost, TransferError, TransferTimeout
from moriio_ray.transfer.base import EngineDesc, Local, MemoryDesc, Transfer, TransferAgent, connected
from moriio_ray.transfer.handle import FutureTransfer
from moriio_ray.transfer.plan import TransferPlan
from moriio_ray.transfer.tcp_client import PeerPool
from moriio_ray.transfer.tcp_region import Region, make_region
from moriio_ray.transfer.tcp_server import TcpServer
from moriio_ray.transfer.tcp_wire import OK, OPS, REQUEST, error_for, recv_status, send_all, set_deadline
from moriio_ray.transfer.threads import ThreadPool

_MAX_CONNS_PER_PEER = 4
_NUM_THREADS = 8


class _Address(msgspec.Struct, frozen=True):
    host: str
    port: int


def _memory_kinds() -> frozenset[str]:
    return frozenset({"cpu", "cuda"}) if torch.cuda.is_available() else frozenset({"cpu"})


class TcpAgent(TransferAgent):
    """The tcp transfer agent (see the module docstring)."""

    name: ClassVar[str] = "tcp"
    memory_kinds: ClassVar[frozenset[str]] = _memory_kinds()
    server_class: ClassVar[type[TcpServer]] = TcpServer  # the server side of this agent's regions

    def __init__(self, config: Any, key: str, *, epoch: int = 1, token: bytes | None = None) -> None:
        super().__init__(config, key, epoch=epoch, token=token)
        self._io: dict[int, Region] = {}
        self._pools: dict[str, PeerPool] = {}
        try:
            self._server = self.server_class(
                key, epoch, self.token, config.tcp, config.timeout_s, self._io.get
            )
        except OSError as exc:
            raise ConfigError(
                f"transfer.tcp.port: cannot listen on {config.tcp.bind_host}:{config.tcp.port}: {exc}; "
                "use port 0 for an ephemeral port"
            ) from None
        self._threads = ThreadPool(_NUM_THREADS, f"tcp-client-{key}")

    # -- backend hooks --------------------------------------------------------------------------

    def _engine_backend_data(self) -> bytes:
        return msgspec.msgpack.encode(_Address(self._host(), self._server.port))

    def _register(self, mem_id: int, tensor: torch.Tensor) -> bytes:
        self._io[mem_id] = make_region(tensor, self.config.tcp.staging_bytes)
        return b""

    def _deregister(self, mem_id: int) -> None:
        self._io.pop(mem_id, None)

    def _connect(self, desc: EngineDesc) -> None:
        try:
            address = msgspec.msgpack.decode(desc.backend_data, type=_Address)
        except msgspec.DecodeError:
            raise ConfigError(f"peer {desc.key!r}: its descriptor carries no tcp address") from None
        pool = PeerPool(desc, (address.host, address.port), self.token, self.config.tcp, _MAX_CONNS_PER_PEER)
        pool.add(pool.open())  # the first connection proves token and epoch now, not at the first read
        self._pools[desc.key] = pool

    def _disconnect(self, desc: EngineDesc, reason: PeerLost) -> None:
        pool = self._pools.pop(desc.key, None)
        if pool is not None:
            pool.close(reason)

    def _close(self) -> None:
        self._server.close()
        self._threads.close()

    def _transfer(
        self, op: str, local: Local, peer: EngineDesc, remote_mem: MemoryDesc, plan: TransferPlan
    ) -> Transfer:
        pool = connected(self._pools, peer.key)
        transfer = FutureTransfer(plan.num_bytes, plan.num_segments, peer.key)
        pool.track(transfer)
        request = _Request(op, pool, transfer, self._io[local.mem.mem_id], remote_mem, plan)
        self._threads.submit(lambda: request.run(self.config.timeout_s))
        return transfer


class _Request:
    """One batched request, run on a client thread."""

    def __init__(
        self,
        op: str,
        pool: PeerPool,
        transfer: FutureTransfer,
        region: Region,
        remote_mem: MemoryDesc,
        plan: TransferPlan,
    ) -> None:
        self.op, self.pool, self.transfer, self.region = op, pool, transfer, region
        self.remote_mem, self.plan = remote_mem, plan
        self.deadline_s = 0.0
        self.sock: socket.socket | None = None

    def run(self, timeout_s: float) -> None:
        self.deadline_s = time.monotonic() + timeout_s
        key = self.pool.desc.key
        healthy = False
        try:
            if self.transfer.done():
                return  # failed by disconnect while queued
            self.sock = self.pool.acquire(self.deadline_s)
            healthy = self._exchange(self.sock)
            self.transfer.set_done()
        except (TimeoutError, BlockingIOError):  # TransferTimeout, or a socket past its deadline
            self.transfer.set_error(
                TransferTimeout(
                    f"transfer of {self.transfer.num_bytes} bytes with peer {key!r} did not finish within "
                    f"transfer.timeout_s={timeout_s}; the peer is stalled or the network too slow"
                )
            )
        except TransferError as exc:
            healthy = not isinstance(exc, PeerLost)
            self.transfer.set_error(self.pool.error or exc)
        except OSError as exc:
            self.transfer.set_error(self.pool.error or PeerLost(f"peer {key!r}: connection lost: {exc}"))
        finally:
            if self.sock is not None:
                self.pool.release(self.sock, healthy)
            self.pool.untrack(self.transfer)

    def _exchange(self, sock: socket.socket) -> bool:
        """Send the request and move the data; refusals raise with the stream still in sync."""
        plan = self.plan
        head = REQUEST.pack(
            OPS[self.op],
            plan.num_segments,
            self.remote_mem.mem_id,
            self.remote_mem.epoch,
            self.transfer.num_bytes,
        )
        self._tick(0)
        send_all(sock, [head, plan.remote_offsets.data, plan.sizes.data])
        self._expect_ok(sock)
        if self.op == "read":
            self.region.recv(sock, plan.local_offsets, plan.sizes, self._tick)
        else:
            self.region.send(sock, plan.local_offsets, plan.sizes, self._tick)
            self._expect_ok(sock)
        return True

    def _expect_ok(self, sock: socket.socket) -> None:
        code, message, _ = recv_status(sock)
        if code != OK:
            raise error_for(code, message)

    def _tick(self, _moved_bytes: int) -> None:
        """Between batches: stop if the peer was dropped, and keep the socket timeout on the deadline."""
        if self.pool.error is not None:
            raise self.pool.error
        left = self.deadline_s - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        assert self.sock is not None
        set_deadline(self.sock, left)
