"""The transfer-agent contract that every backend fills.

The shape follows ``mori.io.IOEngine``: allocate and register memory, publish an ``EngineDesc``,
connect to peers by descriptor, then move many segments one-sidedly with ``read``/``write`` that
return a ``Transfer`` handle at once. The segments are one ``TransferPlan`` (``plan.py``).
"""

from __future__ import annotations

import abc
import threading
from typing import Any, ClassVar, NamedTuple, TypeVar

import torch

from moriio_ray.errors import (
    ConfigError,
    IncompatiblePeer,
    PeerLost,
    StaleDescriptor,
    TransferError,
)
from moriio_ray.transfer import netinfo
from moriio_ray.transfer.desc import (
    SCHEMA_VERSION,
    EngineDesc,
    MemoryDesc,
    decode_engine_desc,
    decode_memory_desc,
    encode_desc,
)
from moriio_ray.transfer.handle import FutureTransfer, Transfer
from moriio_ray.transfer.plan import TransferPlan

__all__ = [
    "SCHEMA_VERSION",
    "EngineDesc",
    "FutureTransfer",
    "Local",
    "MemoryDesc",
    "Transfer",
    "TransferAgent",
    "TransferPlan",
    "connected",
    "decode_engine_desc",
    "decode_memory_desc",
    "encode_desc",
]

After = torch.cuda.Event | torch.cuda.Stream | None
T = TypeVar("T")


class Local(NamedTuple):
    """The local side of one transfer: a region as this agent's own table registered it."""

    mem: MemoryDesc
    tensor: torch.Tensor
    after: After = None  # the copy starts after this CUDA event or stream (backends with ``orders_after``)


def connected(peers: dict[str, T], key: str) -> T:
    """What a table keeps for the connected peer ``key``; PeerLost once it was disconnected."""
    state = peers.get(key)
    if state is None:
        raise PeerLost(f"peer {key!r} is not connected (or was disconnected)")
    return state


# ----------------------------------------------------------------------------------------------
# The agent


class TransferAgent(abc.ABC):
    """One engine's transfer agent.

    Contract:
    - ``allocate`` returns memory this backend can export; ``register`` turns a contiguous tensor
      into a ``MemoryDesc`` that peers use to address it.
    - ``connect(desc)`` is idempotent; it refuses another backend or schema, and a descriptor from
      an older epoch than one already connected for that key (``StaleDescriptor``).
    - ``read``/``write`` never block on the data: they check the plan's bounds once per side, issue
      the whole batch and return a ``Transfer``. The local side is checked against this agent's
      table; the remote side against the owner's table where the backend reaches it at issue
      (``checks_remote_bounds``), else against the descriptor. A tcp server checks its own side too.
    - ``after=`` (a CUDA event or stream) starts the copy after it, on backends with ``orders_after``.
    - ``disconnect(key)`` drops the peer and fails its in-flight transfers with ``PeerLost``.
    - ``close`` releases every resource (sockets, shared memory, IPC handles).
    """

    name: ClassVar[str] = ""
    supports_read: ClassVar[bool] = True
    supports_write: ClassVar[bool] = True
    same_host_only: ClassVar[bool] = False
    memory_kinds: ClassVar[frozenset[str]] = frozenset({"cpu"})
    checks_remote_bounds: ClassVar[bool] = False  # ``_transfer`` checks the owner's table at issue
    orders_after: ClassVar[bool] = False  # ``_transfer`` honours ``Local.after``

    def __init__(self, config: Any, key: str, *, epoch: int = 1, token: bytes | None = None) -> None:
        from moriio_ray import env

        self.config = config  # a TransferConfig
        self.key = key
        self.epoch = epoch
        self.token = token if token is not None else env.cluster_token()
        self._lock = threading.RLock()
        self._regions: dict[int, Local] = {}
        self._next_mem_id = 1
        self._peers: dict[str, EngineDesc] = {}
        self._closed = False

    # -- memory ---------------------------------------------------------------------------------

    def allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device
    ) -> torch.Tensor:
        """Memory this backend can export. The default is plain (pinned when possible) memory."""
        dev = torch.device(device)
        self._check_device(dev)
        if dev.type == "cpu":
            return torch.zeros(shape, dtype=dtype)
        return torch.zeros(shape, dtype=dtype, device=dev)

    def register(self, tensor: torch.Tensor) -> MemoryDesc:
        """Register a contiguous tensor; returns the descriptor peers use to reach it."""
        if not tensor.is_contiguous():
            raise ConfigError("tensor: only contiguous tensors can be registered")
        self._check_device(tensor.device)
        with self._lock:
            mem_id = self._next_mem_id
            self._next_mem_id += 1
            num_bytes = tensor.numel() * tensor.element_size()
            backend_data = self._register(mem_id, tensor)
            desc = MemoryDesc(
                engine_key=self.key,
                epoch=self.epoch,
                mem_id=mem_id,
                num_bytes=num_bytes,
                device=str(tensor.device),
                backend_data=backend_data,
            )
            self._regions[mem_id] = Local(desc, tensor)
            return desc

    def deregister(self, mem: MemoryDesc) -> None:
        with self._lock:
            if self._regions.pop(mem.mem_id, None) is not None:
                self._deregister(mem.mem_id)

    def local_tensor(self, mem: MemoryDesc) -> torch.Tensor:
        """The tensor behind one of this agent's own descriptors."""
        return self._registered(mem).tensor

    def _registered(self, mem: MemoryDesc) -> Local:
        if mem.engine_key != self.key or mem.epoch != self.epoch:
            raise ConfigError(
                f"local_mem: descriptor of {mem.engine_key!r} epoch {mem.epoch} is not this "
                f"agent's ({self.key!r} epoch {self.epoch})"
            )
        local = self._regions.get(mem.mem_id)
        if local is None:
            raise ConfigError(f"local_mem: region {mem.mem_id} is not registered (or was deregistered)")
        return local

    # -- peers ----------------------------------------------------------------------------------

    def engine_desc(self) -> EngineDesc:
        return EngineDesc(
            key=self.key,
            backend=self.name,
            host=self._host(),
            pid=self._pid(),
            epoch=self.epoch,
            node_id=self._node_id(),
            machine_id=netinfo.machine_id(),
            backend_data=self._engine_backend_data(),
        )

    def connect(self, desc: EngineDesc) -> None:
        """Connect to a peer (idempotent). A newer epoch replaces the old one and fails its transfers."""
        if desc.schema_version != SCHEMA_VERSION:
            raise IncompatiblePeer(
                f"peer {desc.key!r} speaks descriptor schema {desc.schema_version}, this agent "
                f"{SCHEMA_VERSION}; run the same moriio-ray version on both"
            )
        if desc.backend != self.name:
            raise IncompatiblePeer(
                f"peer {desc.key!r} uses backend {desc.backend!r}, this agent {self.name!r}; "
                "set the same transfer.backend on every engine"
            )
        if self.same_host_only and not self._same_machine(desc):
            raise IncompatiblePeer(
                f"peer {desc.key!r} is on host {desc.host}, and backend {self.name!r} reaches only "
                f"this host ({self._host()}); use tcp or mori across hosts"
            )
        with self._lock:
            known = self._peers.get(desc.key)
            if known is not None:
                if desc.epoch < known.epoch:
                    raise StaleDescriptor(
                        f"peer {desc.key!r}: descriptor epoch {desc.epoch} is older than the "
                        f"connected epoch {known.epoch}"
                    )
                if desc.epoch == known.epoch and desc == known:
                    return
                self._disconnect(known, PeerLost(f"peer {desc.key!r} was replaced by epoch {desc.epoch}"))
                del self._peers[desc.key]  # its resources are gone even if the new connect fails
            self._connect(desc)
            self._peers[desc.key] = desc

    def disconnect(self, key: str) -> None:
        """Drop a peer; its in-flight transfers fail with PeerLost."""
        with self._lock:
            desc = self._peers.pop(key, None)
            if desc is not None:
                self._disconnect(desc, PeerLost(f"peer {key!r} (epoch {desc.epoch}) was disconnected"))

    def peers(self) -> dict[str, EngineDesc]:
        with self._lock:
            return dict(self._peers)

    # -- transfers ------------------------------------------------------------------------------

    def read(
        self, local_mem: MemoryDesc, remote_mem: MemoryDesc, plan: TransferPlan, *, after: After = None
    ) -> Transfer:
        """Pull ``remote[plan.remote_offsets[i]:+sizes[i]]`` into ``local[plan.local_offsets[i]:...]``."""
        return self._issue("read", local_mem, remote_mem, plan, after)

    def write(
        self, local_mem: MemoryDesc, remote_mem: MemoryDesc, plan: TransferPlan, *, after: After = None
    ) -> Transfer:
        """Push ``local[plan.local_offsets[i]:+sizes[i]]`` into ``remote[plan.remote_offsets[i]:...]``."""
        return self._issue("write", local_mem, remote_mem, plan, after)

    def _issue(
        self, op: str, local_mem: MemoryDesc, remote_mem: MemoryDesc, plan: TransferPlan, after: After
    ) -> Transfer:
        if not (self.supports_read if op == "read" else self.supports_write):
            other = "write" if op == "read" else "read"
            raise ConfigError(f"backend: {self.name!r} does not support {op}; use mode {other}")
        if after is not None and not self.orders_after:
            raise ConfigError(
                f"after: backend {self.name!r} cannot order a copy after a CUDA event or stream"
            )
        if self._closed:
            raise TransferError(f"agent {self.key!r} is closed")
        local = self._registered(local_mem)
        peer = self._peer_for(remote_mem)
        plan.check_local(local.mem.num_bytes, f"local region {local_mem.mem_id} of {self.key!r}")
        if not self.checks_remote_bounds:
            plan.check_remote(
                remote_mem.num_bytes, f"region {remote_mem.mem_id} of {remote_mem.engine_key!r}"
            )
        if after is not None:
            local = local._replace(after=after)
        return self._transfer(op, local, peer, remote_mem, plan)

    def _peer_for(self, remote_mem: MemoryDesc) -> EngineDesc:
        with self._lock:
            peer = connected(self._peers, remote_mem.engine_key)
        if remote_mem.epoch != peer.epoch:
            raise StaleDescriptor(
                f"region {remote_mem.mem_id} of {remote_mem.engine_key!r} comes from epoch "
                f"{remote_mem.epoch}, the connected peer is epoch {peer.epoch}"
            )
        return peer

    def _same_machine(self, desc: EngineDesc) -> bool:
        if desc.machine_id:
            return desc.machine_id == netinfo.machine_id()
        return desc.host == self._host()

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for key in list(self._peers):
                self.disconnect(key)
            for mem_id in list(self._regions):
                self._regions.pop(mem_id)
                self._deregister(mem_id)
            self._close()

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what backends fill -------------------------------------------------------------------------

    def _check_device(self, device: torch.device) -> None:
        if device.type not in self.memory_kinds:
            raise ConfigError(
                f"device: backend {self.name!r} handles {', '.join(sorted(self.memory_kinds))} memory, "
                f"not {device.type}"
            )

    def _host(self) -> str:
        return netinfo.node_ip()

    def _pid(self) -> int:
        import os

        return os.getpid()

    def _node_id(self) -> str:
        return netinfo.node_id()

    def _engine_backend_data(self) -> bytes:
        return b""

    def _register(self, mem_id: int, tensor: torch.Tensor) -> bytes:
        """Export a region; returns the backend bytes stored in its MemoryDesc."""
        return b""

    def _deregister(self, mem_id: int) -> None:
        """Release what ``_register`` exported."""

    def _connect(self, desc: EngineDesc) -> None:
        """Open what is needed to reach a peer (sockets, mappings, imported handles)."""

    def _disconnect(self, desc: EngineDesc, reason: PeerLost) -> None:
        """Drop a peer: close its connections and fail its in-flight transfers with ``reason``."""

    def _close(self) -> None:
        """Release backend resources."""

    @abc.abstractmethod
    def _transfer(
        self, op: str, local: Local, peer: EngineDesc, remote_mem: MemoryDesc, plan: TransferPlan
    ) -> Transfer:
        """Issue one batched read (``op == 'read'``) or write of ``plan``; its local side is checked."""
