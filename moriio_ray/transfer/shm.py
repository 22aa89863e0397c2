"""Backend ``shm``: same-host CPU memory in POSIX shared memory; a transfer is a plain copy.

``allocate`` puts the tensor in a shared-memory segment (``shm_segment.py``); ``register`` accepts
only memory from there. A peer maps the owner's segment on first use and copies from the caller's
side, segment by segment through memoryviews, so per-segment overhead stays small. The owner's
header is checked when a batch is issued and between its chunks, and the owner's process once the
copy is done: if the owner closed, moved to another epoch or died, the transfer fails with
``PeerLost`` (``StaleDescriptor`` for an epoch), never a success over bytes copied after the owner
was gone.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any, ClassVar

import msgspec
import torch

from moriio_ray.errors import ConfigError, PeerLost, SegmentOutOfBounds, TransferError
from moriio_ray.transfer.base import EngineDesc, Local, MemoryDesc, Transfer, TransferAgent, connected
from moriio_ray.transfer.handle import FutureTransfer
from moriio_ray.transfer.plan import Copy, TransferPlan, batches
from moriio_ray.transfer.shm_segment import Segment, sweep_stale_segments
from moriio_ray.transfer.threads import ThreadPool

__all__ = ["ShmAgent", "sweep_stale_segments"]

_INLINE_BYTES = 1 << 20  # smaller transfers copy in the caller's thread: a handoff would cost more
_CHUNK_BYTES = 16 << 20  # the owner's liveness is checked (and test holds apply) between chunks
_CHUNK_SEGMENTS = 4096
_NUM_THREADS = 2
_SLOW_COPY_BYTES_PER_S = 1e9  # a pessimistic copy rate, to decide whether a waiter may copy itself
_HOLD_MAX_S = 60.0


class _ShmRef(msgspec.Struct, frozen=True):
    name: str  # the owner's segment
    offset: int  # of the region inside the segment's data


class _Peer:
    """A connected peer: its segments, mapped on first use, and its in-flight transfers."""

    def __init__(self, desc: EngineDesc) -> None:
        self.desc = desc
        self.segments: dict[str, Segment] = {}
        self.inflight: set[FutureTransfer] = set()
        self.error: PeerLost | None = None
        self.lock = threading.Lock()

    def segment(self, name: str) -> Segment:
        with self.lock:
            seg = self.segments.get(name)
            if seg is None:
                seg = self.segments[name] = Segment.attach(name, self.desc.key)
            return seg


class ShmAgent(TransferAgent):
    """The shm transfer agent (see the module docstring)."""

    name: ClassVar[str] = "shm"
    same_host_only: ClassVar[bool] = True
    memory_kinds: ClassVar[frozenset[str]] = frozenset({"cpu"})
    checks_remote_bounds: ClassVar[bool] = True  # against the owner's region table in the segment

    def __init__(self, config: Any, key: str, *, epoch: int = 1, token: bytes | None = None) -> None:
        super().__init__(config, key, epoch=epoch, token=token)
        self._owned: list[Segment] = []
        self._shm_peers: dict[str, _Peer] = {}
        self._threads: ThreadPool | None = None
        # unlink this agent's segments at exit even if close() is never called
        self._finalizer = weakref.finalize(self, _retire_all, self._owned)

    # -- memory ---------------------------------------------------------------------------------

    def allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device
    ) -> torch.Tensor:
        """A zeroed tensor in a new shared-memory segment that peers on this host can map."""
        self._check_device(torch.device(device))
        elem_bytes = torch.empty((), dtype=dtype).element_size()
        num_bytes = math.prod(shape) * elem_bytes
        if num_bytes <= 0:
            raise ConfigError(f"shape: {shape} holds no bytes; allocate at least one element")
        seg = Segment.create(self.key, self.epoch, num_bytes)
        with self._lock:
            self._owned.append(seg)
        return torch.from_numpy(seg.data).view(dtype).view(shape)

    def _register(self, mem_id: int, tensor: torch.Tensor) -> bytes:
        start = tensor.data_ptr()
        num_bytes = tensor.numel() * tensor.element_size()
        for seg in self._owned:
            base = seg.data.ctypes.data
            if base <= start and start + num_bytes <= base + seg.data.size:
                seg.add_region(mem_id, start - base, num_bytes)
                return msgspec.msgpack.encode(_ShmRef(seg.name, start - base))
        raise ConfigError(
            "tensor: backend 'shm' registers only shared memory of this agent; "
            "allocate through agent.allocate"
        )

    def _deregister(self, mem_id: int) -> None:
        for seg in self._owned:
            seg.drop_region(mem_id)

    # -- peers ----------------------------------------------------------------------------------

    def _connect(self, desc: EngineDesc) -> None:
        self._shm_peers[desc.key] = _Peer(desc)

    def _disconnect(self, desc: EngineDesc, reason: PeerLost) -> None:
        peer = self._shm_peers.pop(desc.key, None)
        if peer is None:
            return
        with peer.lock:
            peer.error = reason
            inflight, peer.inflight = peer.inflight, set()
            peer.segments.clear()  # unmapped once the last copy that uses them ends
        for transfer in inflight:
            transfer.set_error(reason)

    def _close(self) -> None:
        self._finalizer()  # retire (state 0, unlink) every owned segment
        if self._threads is not None:
            self._threads.close()

    # -- transfers ------------------------------------------------------------------------------

    def _transfer(
        self, op: str, local: Local, peer: EngineDesc, remote_mem: MemoryDesc, plan: TransferPlan
    ) -> Transfer:
        state = connected(self._shm_peers, peer.key)
        try:
            ref = msgspec.msgpack.decode(remote_mem.backend_data, type=_ShmRef)
        except msgspec.DecodeError:
            raise ConfigError(f"remote_mem: region {remote_mem.mem_id} carries no shm reference") from None
        seg = state.segment(ref.name)
        seg.check_live(peer.key, remote_mem.epoch, check_pid=False)  # the process: after the copy
        remote = _remote_view(seg, ref, remote_mem, plan)
        local_view = local.tensor.detach().reshape(-1).view(torch.uint8).numpy().data
        src, dst = (remote, local_view) if op == "read" else (local_view, remote)
        transfer = _ShmTransfer(plan.num_bytes, plan.num_segments, peer.key)
        job = _Copy(self, state, seg, remote_mem.epoch, transfer, src, dst, plan.copy_for(op))
        if transfer.num_bytes < _INLINE_BYTES:
            job.run(hold=False)
            return transfer
        with state.lock:
            if state.error is not None:
                raise state.error
            state.inflight.add(transfer)
        transfer.job = job
        self._pool().submit(job.run_if_unclaimed)
        return transfer

    def _pool(self) -> ThreadPool:
        with self._lock:
            if self._threads is None:
                self._threads = ThreadPool(_NUM_THREADS, f"shm-copy-{self.key}")
            return self._threads

    def _on_copied(self, moved_bytes: int) -> None:
        """Called between the chunks of an asynchronous copy (a no-op here; a subclass may observe
        or pace it)."""


def _remote_view(seg: Segment, ref: _ShmRef, remote_mem: MemoryDesc, plan: TransferPlan) -> memoryview:
    """The registered region as the owner's table has it, with the segments checked against it."""
    entry = seg.region_bytes(remote_mem.mem_id)
    if entry is None or entry[0] != ref.offset:
        raise TransferError(
            f"region {remote_mem.mem_id} of {remote_mem.engine_key!r} is not registered (or was deregistered)"
        )
    offset, num_bytes = entry
    try:
        plan.check_remote(num_bytes, f"region {remote_mem.mem_id} of {remote_mem.engine_key!r}")
    except SegmentOutOfBounds as exc:
        raise SegmentOutOfBounds(f"{exc}, refused by the owner's region table") from None
    return seg.data[offset : offset + num_bytes].data


class _ShmTransfer(FutureTransfer):
    """A copy that a worker runs, or the caller itself when it waits before any worker started it.

    Issue-then-wait, the common pattern, then costs no thread handoff. The caller takes the copy
    only when ``timeout_s`` leaves room for it at a pessimistic 1 GB/s, so that ``wait`` keeps its
    timeout.
    """

    job: _Copy | None = None

    def wait(self, timeout_s: float | None = None) -> None:
        job = self.job
        if job is not None and (timeout_s is None or self.num_bytes / _SLOW_COPY_BYTES_PER_S <= timeout_s):
            job.run_if_unclaimed()
        super().wait(timeout_s)


class _Copy:
    """One batched copy, in chunks, with the owner's liveness checked around each chunk."""

    def __init__(
        self,
        agent: ShmAgent,
        peer: _Peer,
        seg: Segment,
        epoch: int,
        transfer: FutureTransfer,
        src: memoryview,
        dst: memoryview,
        copy: Copy,
    ) -> None:
        self.agent, self.peer, self.seg, self.epoch, self.transfer = agent, peer, seg, epoch, transfer
        self.src, self.dst, self.copy = src, dst, copy

        self._claimed = threading.Lock()

    def run_if_unclaimed(self) -> None:
        """Run the copy unless another thread (a worker or the waiting caller) already took it."""
        if self._claimed.acquire(blocking=False):
            self.run()

    def run(self, hold: bool = True) -> None:
        try:
            self._copy(hold)
            self.transfer.set_done()
        except TransferError as exc:
            self.transfer.set_error(self.peer.error or exc)
        finally:
            with self.peer.lock:
                self.peer.inflight.discard(self.transfer)

    def _copy(self, hold: bool) -> None:
        key = self.peer.desc.key
        src, dst, copy = self.src, self.dst, self.copy
        moved = 0
        for start, stop in batches(copy.sizes, _CHUNK_SEGMENTS, _CHUNK_BYTES):
            if self.peer.error is not None:
                raise self.peer.error
            sl = slice(start, stop)
            so, do, sz = copy.src_offsets[sl].tolist(), copy.dst_offsets[sl].tolist(), copy.sizes[sl].tolist()
            for s, d, n in zip(so, do, sz, strict=True):
                dst[d : d + n] = src[s : s + n]
            moved += sum(sz)
            if hold:
                self.agent._on_copied(moved)
            # between chunks the owner's control word (a memory read) stops a copy early
            self.seg.check_live(key, self.epoch, check_pid=False)
        # at the end the process too: bytes copied after the owner left must not count as success
        self.seg.check_live(key, self.epoch)
        if self.peer.error is not None:
            raise self.peer.error


def _retire_all(segments: list[Segment]) -> None:
    for seg in segments:
        seg.retire()
    segments.clear()
