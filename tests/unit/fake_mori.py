"""A FAKE ``mori`` package (``mori`` and ``mori.io``) for the unit tests of the mori backend.

Why a fake: there is no AMD GPU or RDMA NIC here, and the real ``amd-mori`` wheels are built for
CPython 3.10 on ROCm only, so the real module cannot even be imported. This fake stands in at the
import boundary (``sys.modules``) and mirrors amd-mori 1.2.4. It cannot offer more than that:
``tests/unit/test_mori_surface.py`` checks every name it exports, every public method (with its
parameters) and every attribute of its objects against the API read from the real 1.2.4 wheel.
Like the real package, ``mori.io`` does not export ``TransferStatus`` (it lives in ``mori.cpp``).

- configs take the real keyword names and defaults (``RdmaBackendConfig(qp_per_transfer=1,
  post_batch_size=-1, num_worker_threads=-1, poll_cq_mode=POLLING, enable_notification=True)``);
- offsets and sizes must be sequences of Python ints, as a pybind11 ``std::vector<size_t>`` needs;
- ``EngineDesc``/``MemoryDesc`` only travel as ``pack()`` bytes and come back through ``unpack``;
- statuses are held by weak reference, like the raw pointers of the C++ side: completing a status
  that Python already freed is recorded in ``Fabric.dangling`` (a use-after-free on real hardware).

It moves bytes for real between registered CPU tensors, so round trips exercise the adapter.
Completion is either immediate or held until the test calls ``Fabric.complete``. A test reports a
dead peer with ``Fabric.fail_peer``: every engine that knows it gets a ``PeerFailureEvent`` from
``pop_peer_failure()`` and its sessions to it stop being ``alive()``, as MoRI's RDMA backend does
when a queue pair fails. Every call is recorded in ``Fabric.calls`` as ``(engine_key, method, args)``.
"""

from __future__ import annotations

import collections
import functools
import itertools
import sys
import time
import types
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from fake_mori_types import (
    BackendConfig,
    BackendType,
    EngineDesc,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    PeerFailureEvent,
    PeerFailureReason,
    PollCqMode,
    RdmaBackendConfig,
    StatusCode,
    TransferStatus,
    XgmiBackendConfig,
    _failed,
)

__all__ = [  # the value types are tests' to use through this module too
    "BackendType",
    "EngineDesc",
    "Fabric",
    "IOEngine",
    "IOEngineConfig",
    "IOEngineSession",
    "MemoryDesc",
    "MemoryLocationType",
    "PeerFailureEvent",
    "PeerFailureReason",
    "PollCqMode",
    "RdmaBackendConfig",
    "StatusCode",
    "TransferStatus",
    "XgmiBackendConfig",
    "build_modules",
    "cpu_agent_class",
    "install",
    "make_agent",
]


@dataclass
class _Pending:
    status_ref: weakref.ref[TransferStatus]
    move: Any  # () -> None, copies the bytes


@dataclass
class Fabric:
    """Process-wide state of the fake: engines, registered tensors, pending completions."""

    immediate: bool = True
    engines: dict[str, IOEngine] = field(default_factory=dict)
    tensors: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    pending: list[_Pending] = field(default_factory=list)
    calls: list[tuple[str, str, tuple[Any, ...]]] = field(default_factory=list)
    dangling: int = 0  # completions of statuses that Python had already freed
    fail_next: tuple[StatusCode, str] | None = None

    def complete(self, code: StatusCode = StatusCode.SUCCESS, msg: str = "") -> int:
        """Finish every pending transfer (moving its bytes on success); returns how many."""
        pending, self.pending = self.pending, []
        for item in pending:
            self._finish(item, code, msg)
        return len(pending)

    def _finish(self, item: _Pending, code: StatusCode, msg: str) -> None:
        status = item.status_ref()
        if status is None:
            self.dangling += 1
            return
        if code == StatusCode.SUCCESS:
            try:
                item.move()
            except KeyError as exc:  # a region was deregistered mid-flight: the NIC reports an error
                code, msg = StatusCode.ERR_RDMA_OP, f"memory region {exc} was deregistered"
        status.Update(code, msg)

    def methods(self, engine_key: str, name: str) -> list[tuple[Any, ...]]:
        return [args for key, method, args in self.calls if key == engine_key and method == name]

    def fail_peer(
        self,
        engine_key: str,
        reason: PeerFailureReason = PeerFailureReason.PEER_UNREACHABLE,
        detail: str = "retry exceeded on qp",
    ) -> int:
        """The peer ``engine_key`` is unreachable: every engine that knows it gets a failure event and
        its sessions to it die. Returns how many engines were told."""
        told = 0
        for engine in self.engines.values():
            if engine_key in engine._remotes:
                event = PeerFailureEvent(engine_key, reason, 17, 1, "fake_rdma0", detail)
                self.push_failure(engine._key, event)
                engine._dead_peers.add(engine_key)
                told += 1
        return told

    def break_sessions(self, engine_key: str, peer_engine_key: str) -> None:
        """Sessions of engine ``engine_key`` to ``peer_engine_key`` stop being alive (no event)."""
        self.engines[engine_key]._dead_peers.add(peer_engine_key)

    def push_failure(self, engine_key: str, event: PeerFailureEvent) -> None:
        """Queue one event for ``pop_peer_failure`` of engine ``engine_key`` (a local fault has no peer)."""
        self.engines[engine_key]._failures.append(event)


FABRIC = Fabric()
_uids = itertools.count(1)


def _check_sizes(name: str, values: Any) -> list[int]:
    if not isinstance(values, (list, tuple)) or not all(type(v) is int for v in values):
        raise TypeError(f"{name}: incompatible function arguments; expected a list of int (size_t)")
    if any(v < 0 for v in values):
        raise TypeError(f"{name}: negative value cannot convert to size_t")
    return list(values)


@dataclass
class _CppSession:
    """What the real wrapper holds as ``mori_sess`` (a pybind IOEngineSession)."""

    engine: IOEngine
    local: MemoryDesc
    remote: MemoryDesc


class IOEngineSession:
    def __init__(self, mori_sess: _CppSession) -> None:
        self._sess = mori_sess

    def allocate_transfer_uid(self) -> int:
        return next(_uids)

    def batch_read(self, local_offsets: Any, remote_offsets: Any, sizes: Any, transfer_uid: int) -> Any:
        s = self._sess
        return s.engine._batch("read", s.local, s.remote, local_offsets, remote_offsets, sizes)

    def batch_write(self, local_offsets: Any, remote_offsets: Any, sizes: Any, transfer_uid: int) -> Any:
        s = self._sess
        return s.engine._batch("write", s.local, s.remote, local_offsets, remote_offsets, sizes)

    def alive(self) -> bool:
        key = self._sess.remote.engine_key
        return key in self._sess.engine._remotes and key not in self._sess.engine._dead_peers


class IOEngine:
    def __init__(self, key: str, config: IOEngineConfig) -> None:
        if not isinstance(config, IOEngineConfig):
            raise TypeError("config must be an IOEngineConfig")
        self._key = key
        self._config = config
        self._backends: dict[BackendType, BackendConfig] = {}
        self._remotes: dict[str, EngineDesc] = {}
        self._dead_peers: set[str] = set()
        self._failures: collections.deque[PeerFailureEvent] = collections.deque()
        self._mem_ids = itertools.count(1)
        FABRIC.engines[key] = self
        self._record("__init__", key, config.host, config.port)

    def _record(self, method: str, *args: Any) -> None:
        FABRIC.calls.append((self._key, method, args))

    def get_engine_desc(self) -> EngineDesc:
        return EngineDesc(self._key, "fakehost", self._config.host, 40000 + len(FABRIC.engines))

    def create_backend(self, type: BackendType, config: BackendConfig | None = None) -> None:
        expected = {BackendType.RDMA: RdmaBackendConfig, BackendType.XGMI: XgmiBackendConfig}[type]
        if config is None or not isinstance(config, expected):
            raise TypeError(f"{type} needs a {expected.__name__}, got {config!r}")
        self._backends[type] = config
        self._record("create_backend", type, config)

    def register_remote_engine(self, engine_desc: EngineDesc) -> None:
        if not isinstance(engine_desc, EngineDesc):
            raise TypeError("register_remote_engine takes an EngineDesc (unpack the bytes first)")
        self._remotes[engine_desc.key] = engine_desc
        self._dead_peers.discard(engine_desc.key)
        self._record("register_remote_engine", engine_desc)

    def deregister_remote_engine(self, engine_desc: EngineDesc) -> None:
        self._remotes.pop(engine_desc.key, None)
        self._record("deregister_remote_engine", engine_desc)

    def register_torch_tensor(self, tensor: torch.Tensor) -> MemoryDesc:
        if not tensor.is_contiguous():
            raise RuntimeError("input tensor must be contiguous")
        loc = MemoryLocationType.GPU if tensor.device.type == "cuda" else MemoryLocationType.CPU
        device_id = -1 if tensor.device.index is None else tensor.device.index
        num_bytes = tensor.numel() * tensor.element_size()
        desc = MemoryDesc(self._key, next(self._mem_ids), device_id, tensor.data_ptr(), num_bytes, loc)
        FABRIC.tensors[(self._key, desc.id)] = tensor
        self._record("register_torch_tensor", desc)
        return desc

    def deregister_memory(self, mem_desc: MemoryDesc) -> None:
        FABRIC.tensors.pop((self._key, mem_desc.id), None)
        self._record("deregister_memory", mem_desc)

    def allocate_transfer_uid(self) -> int:
        return next(_uids)

    def create_session(self, local_mem: MemoryDesc, remote_mem: MemoryDesc) -> IOEngineSession | None:
        self._record("create_session", local_mem, remote_mem)
        if not isinstance(local_mem, MemoryDesc) or not isinstance(remote_mem, MemoryDesc):
            raise TypeError("create_session takes two MemoryDesc")
        if remote_mem.engine_key not in self._remotes or not self._backends:
            return None
        return IOEngineSession(_CppSession(self, local_mem, remote_mem))

    def pop_peer_failure(self) -> PeerFailureEvent | None:
        return self._failures.popleft() if self._failures else None

    def wait_all(self, statuses: Any, timeout_ms: int = -1) -> StatusCode:
        """Wait until every status is terminal or ``timeout_ms`` passed; the first failure's code,
        IN_PROGRESS if some are still running, else SUCCESS."""
        if not isinstance(statuses, list) or not all(isinstance(s, TransferStatus) for s in statuses):
            raise TypeError("wait_all: statuses must be a list of TransferStatus")
        self._record("wait_all", len(statuses), timeout_ms)
        deadline_s = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        for status in statuses:
            left_ms = -1 if deadline_s is None else max(0, int((deadline_s - time.monotonic()) * 1000))
            status.WaitFor(left_ms)
        codes = [s.Code() for s in statuses]
        failed = [c for c in codes if _failed(c)]
        if failed:
            return failed[0]
        return StatusCode.SUCCESS if all(c is StatusCode.SUCCESS for c in codes) else StatusCode.IN_PROGRESS

    def _batch(
        self, op: str, local: MemoryDesc, remote: MemoryDesc, lo: Any, ro: Any, sz: Any
    ) -> TransferStatus:
        lo, ro, sz = (
            _check_sizes("local_offsets", lo),
            _check_sizes("remote_offsets", ro),
            _check_sizes("sizes", sz),
        )
        self._record(f"batch_{op}", local, remote, lo, ro, sz)
        status = TransferStatus()
        if not len(lo) == len(ro) == len(sz):
            status.Update(StatusCode.ERR_INVALID_ARGS, "offsets and sizes differ in length")
            return status
        if remote.engine_key not in self._remotes or (remote.engine_key, remote.id) not in FABRIC.tensors:
            status.Update(StatusCode.ERR_NOT_FOUND, f"remote engine or memory {remote.engine_key} not found")
            return status
        for off_l, off_r, size in zip(lo, ro, sz, strict=True):
            if off_l + size > local.size or off_r + size > remote.size:
                status.Update(StatusCode.ERR_INVALID_ARGS, "segment out of range")
                return status
        if FABRIC.fail_next is not None:
            code, msg = FABRIC.fail_next
            FABRIC.fail_next = None
            status.Update(code, msg)
            return status
        src_key, dst_key = (remote, local) if op == "read" else (local, remote)
        src_offs, dst_offs = (ro, lo) if op == "read" else (lo, ro)

        def move() -> None:
            src = FABRIC.tensors[(src_key.engine_key, src_key.id)].view(-1).view(torch.uint8)
            dst = FABRIC.tensors[(dst_key.engine_key, dst_key.id)].view(-1).view(torch.uint8)
            for s, d, n in zip(src_offs, dst_offs, sz, strict=True):
                dst[d : d + n].copy_(src[s : s + n])

        status.SetCode(StatusCode.IN_PROGRESS)
        item = _Pending(weakref.ref(status), move)
        if FABRIC.immediate:
            FABRIC._finish(item, StatusCode.SUCCESS, "")
        else:
            FABRIC.pending.append(item)
        return status


# What the fake mori.io exports: each must be a name the real mori.io 1.2.4 exports.
IO_EXPORTS: tuple[type, ...] = (
    BackendType,
    MemoryLocationType,
    StatusCode,
    PollCqMode,
    PeerFailureReason,
    PeerFailureEvent,
    RdmaBackendConfig,
    XgmiBackendConfig,
    IOEngineConfig,
    EngineDesc,
    MemoryDesc,
    IOEngine,
    IOEngineSession,
)


def build_modules() -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """(mori, mori.io, mori.cpp) of this fake, not yet installed."""
    io = types.ModuleType("mori.io")
    io.__doc__ = "FAKE mori.io for unit tests (see tests/unit/fake_mori.py)"
    for obj in IO_EXPORTS:
        setattr(io, obj.__name__, obj)
    cpp = types.ModuleType("mori.cpp")
    cpp.__doc__ = "FAKE mori.cpp: the classes mori.io does not re-export"
    cpp.TransferStatus = TransferStatus  # type: ignore[attr-defined]
    pkg = types.ModuleType("mori")
    pkg.__path__ = []  # a package, so that `import mori.io` resolves through sys.modules
    pkg.__version__ = "1.2.4"  # type: ignore[attr-defined]
    pkg.io = io  # type: ignore[attr-defined]
    pkg.cpp = cpp  # type: ignore[attr-defined]
    return pkg, io, cpp


def install(monkeypatch: Any, *, immediate: bool = True) -> Fabric:
    """Put this fake at ``sys.modules['mori']``/``['mori.io']`` (undone by monkeypatch); fresh state."""
    global FABRIC
    FABRIC = Fabric(immediate=immediate)
    pkg, io, cpp = build_modules()
    monkeypatch.setitem(sys.modules, "mori", pkg)
    monkeypatch.setitem(sys.modules, "mori.io", io)
    monkeypatch.setitem(sys.modules, "mori.cpp", cpp)
    return FABRIC


@functools.cache
def cpu_agent_class() -> type:
    """TEST-ONLY: ``MoriAgent`` (the contract suite's holding double of it) that also accepts CPU
    tensors, since there is no GPU here.

    MoRI's RDMA backend registers host memory too (``MemoryLocationType.CPU``); the production
    agent advertises only ``cuda`` because engines keep their KV cache on the GPU.
    """
    from tests.contract.hooks import HoldingMoriAgent

    class CpuMoriAgent(HoldingMoriAgent):
        memory_kinds = frozenset({"cpu", "cuda"})

    return CpuMoriAgent


def make_agent(key: str, *, epoch: int = 1, timeout_s: float = 10.0, **mori_knobs: Any) -> Any:
    """A CPU-capable MoriAgent on the fake, with ``transfer.mori`` set from ``mori_knobs``."""
    from moriio_ray.config import MoriConfig, TransferConfig

    config = TransferConfig(backend="mori", timeout_s=timeout_s, mori=MoriConfig(**mori_knobs))
    return cpu_agent_class()(config, key, epoch=epoch)


def live_transfers(agent: Any) -> int:
    """Transfers a MoriAgent still keeps alive because MoRI may yet write their statuses (it drops
    the others first, as its next transfer would)."""
    with agent._lock:
        agent._live = [t for t in agent._live if not t.statuses_terminal()]
        return len(agent._live)
