"""cuda_ipc: KV transfers between NVIDIA GPUs of one host through CUDA IPC.

- **Memory.** ``allocate`` gives each region its own cudaMalloc allocation; ``register`` exports
  any contiguous GPU tensor as the IPC handle of its allocation plus an offset. A peer in another
  process opens the handle (lazily enabling peer access); a peer in the same process uses the
  pointer directly, after enabling peer access between the two GPUs.
- **Transfers.** ``read`` pulls on the reader's GPU, ``write`` pushes from the writer's GPU, on a
  copy stream dedicated to this agent and device. ``transfer.cuda_ipc.method`` picks how
  (``cuda_methods.py``): one SM kernel launch over all N segments (``cuda_kernels.py``), one
  batched submission to the copy engines (``cuda_copy_engine.py``), or one memcpy per segment;
  ``auto`` picks by size.
- **Host path.** Stream ordering, the launch and the completion event are driver calls through
  ctypes (``cuda_driver.py``), a few microseconds in all; the offsets go through a ring of pinned
  buffers.
- **Completion.** A CUDA event recorded after the copy (``cuda_transfer.CudaTransfer``).
- **Ordering with compute.** By default a copy starts after the work already queued on the
  caller's current stream of the local GPU. ``read``/``write`` take ``after=`` (a ``torch.cuda.Event``
  or ``torch.cuda.Stream``) to start after that instead, e.g. ``agent.write(..., after=layer_done[i])``.
- **Ray.** Workers must see the host's GPUs: see ``cuda_devices.ray_actor_env``/``select_device``.

CuPy and the CUDA driver are loaded only here, so only when cuda_ipc is chosen.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import uuid
from typing import Any, ClassVar

import msgspec
import numpy as np
import torch

from moriio_ray.errors import BackendUnavailable, ConfigError, PeerLost, StaleDescriptor
from moriio_ray.transfer import cuda_driver, cuda_memory, cuda_methods
from moriio_ray.transfer.base import EngineDesc, Local, MemoryDesc, Transfer, TransferAgent
from moriio_ray.transfer.cuda_copy_engine import CopyEngine
from moriio_ray.transfer.cuda_devices import device_uuids, enable_peer_access, index_of_uuid
from moriio_ray.transfer.cuda_kernels import KernelVariant, SegmentCopier, cupy_module
from moriio_ray.transfer.cuda_transfer import CudaTransfer, Event, pid_alive
from moriio_ray.transfer.plan import Copy, TransferPlan

_PROCESS_ID = uuid.uuid4().hex  # tells a same-process peer from a process that reuses a pid


class CudaEngineInfo(msgspec.Struct, frozen=True):
    """``EngineDesc.backend_data`` of a cuda_ipc agent."""

    process_id: str
    pid: int
    pid_namespace: int  # liveness checks by pid only make sense inside one PID namespace


@functools.lru_cache(maxsize=1)
def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _raw_stream_getter() -> Any:
    """index -> the raw handle of torch's current stream there, without building a Stream object."""
    fast = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if fast is not None:
        return fast
    return lambda index: torch.cuda.current_stream(index).cuda_stream


class _Lane:
    """One local GPU: its copy stream, kernel launcher and copy-engine submitter, under one lock."""

    def __init__(
        self, device: torch.device, config: Any, variant: KernelVariant | None, engine_opts: dict[str, bool]
    ) -> None:
        assert device.index is not None
        self.index = device.index
        self.stream = torch.cuda.Stream(device=device)
        self.handle = int(self.stream.cuda_stream)
        self.copier = SegmentCopier(device, self.stream, variant, max_ctas=config.max_ctas)
        self.engine = CopyEngine(device.index, **engine_opts)
        self.ctx = self.copier.ctx
        self.order = cuda_driver.RawEvent()  # re-recorded on the caller's stream before each copy
        self.lock = threading.Lock()


class CudaIpcAgent(TransferAgent):
    """Transfer agent for NVIDIA GPUs of one host (see the module docstring)."""

    name: ClassVar[str] = "cuda_ipc"
    same_host_only: ClassVar[bool] = True
    memory_kinds: ClassVar[frozenset[str]] = frozenset({"cuda"})
    checks_remote_bounds: ClassVar[bool] = True  # against the peer's allocation as mapped here
    orders_after: ClassVar[bool] = True

    def __init__(self, config: Any, key: str, *, epoch: int = 1, token: bytes | None = None) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailable("transfer.backend: cuda_ipc needs a CUDA GPU; none is visible here")
        cupy_module()
        super().__init__(config, key, epoch=epoch, token=token)
        self._uuids = device_uuids()
        self._lanes: dict[int, _Lane] = {}
        self._peer_info: dict[str, CudaEngineInfo] = {}
        # peer key -> {(handle, local device): (base, size)} of opened IPC mappings
        self._imports: dict[str, dict[tuple[bytes, int], tuple[int, int]]] = {}
        # (peer, epoch, mem_id, device) -> (address, registered bytes really mapped there)
        self._ptrs: dict[tuple[str, int, int, int], tuple[int, int]] = {}
        self._inflight: dict[str, collections.deque[CudaTransfer]] = {}
        self._current_stream = _raw_stream_getter()
        # Benchmarks: give each Transfer a start event after its waits, so device time excludes them.
        self.time_transfers = False
        self.kernel_variant: KernelVariant | None = None  # None: cuda_kernels.DEFAULT_VARIANT
        self._engine_options: dict[str, bool] = {}  # CopyEngine options (``tune``)

    # -- memory ---------------------------------------------------------------------------------

    def allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device
    ) -> torch.Tensor:
        """A zeroed tensor in its own device allocation, so that exactly it can be exported."""
        dev = torch.device(device)
        self._check_device(dev)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        num_bytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        return cuda_memory.allocate(num_bytes, dev).view(dtype).view(shape)

    def _register(self, mem_id: int, tensor: torch.Tensor) -> bytes:
        assert tensor.device.index is not None
        region = cuda_memory.export_region(tensor, self._uuids[tensor.device.index])
        return msgspec.msgpack.encode(region)

    def stream(self, device: torch.device | int) -> torch.cuda.Stream:
        """The copy stream this agent uses on a local GPU (benchmarks record events on it)."""
        return self._lane(torch.device("cuda", device) if isinstance(device, int) else device).stream

    def _lane(self, device: torch.device) -> _Lane:
        assert device.index is not None
        lane = self._lanes.get(device.index)
        if lane is None:
            with self._lock:
                lane = self._lanes.get(device.index)
                if lane is None:
                    with torch.cuda.device(device.index):
                        lane = _Lane(device, self.config.cuda_ipc, self.kernel_variant, self._engine_options)
                    self._lanes[device.index] = lane
        return lane

    # -- peers ----------------------------------------------------------------------------------

    def _engine_backend_data(self) -> bytes:
        return msgspec.msgpack.encode(CudaEngineInfo(_PROCESS_ID, os.getpid(), _pid_namespace()))

    def _connect(self, desc: EngineDesc) -> None:
        try:
            info = msgspec.msgpack.decode(desc.backend_data, type=CudaEngineInfo)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"peer {desc.key!r}: its descriptor carries no cuda_ipc engine data") from exc
        self._peer_info[desc.key] = info
        self._imports.setdefault(desc.key, {})
        self._inflight.setdefault(desc.key, collections.deque())

    def _disconnect(self, desc: EngineDesc, reason: PeerLost) -> None:
        transfers = list(self._inflight.pop(desc.key, ()))
        for t in transfers:
            t.fail(reason)
        # A running kernel may still touch the mappings: let it finish before unmapping.
        for t in transfers:
            t.event.synchronize()
        for (_, device_index), (base, _) in self._imports.pop(desc.key, {}).items():
            cuda_memory.close_handle(base, device_index)
        self._ptrs = {k: v for k, v in self._ptrs.items() if k[0] != desc.key}
        self._peer_info.pop(desc.key, None)

    def _same_process(self, peer_key: str) -> bool:
        return self._peer_info[peer_key].process_id == _PROCESS_ID

    def _peer_alive(self, peer_key: str, *, thorough: bool = True) -> bool:
        info = self._peer_info.get(peer_key)
        if info is None or info.process_id == _PROCESS_ID or info.pid_namespace != _pid_namespace():
            return True
        return pid_alive(info.pid, zombie_is_dead=thorough)

    def _remote_region(self, peer: EngineDesc, remote_mem: MemoryDesc, device_index: int) -> tuple[int, int]:
        """(address usable by kernels on ``device_index``, bytes really there) of a remote region."""
        cache_key = (peer.key, peer.epoch, remote_mem.mem_id, device_index)
        known = self._ptrs.get(cache_key)
        if known is not None:
            return known
        region = msgspec.msgpack.decode(remote_mem.backend_data, type=cuda_memory.CudaRegion)
        remote_index = index_of_uuid(region.device_uuid)
        if self._same_process(peer.key):
            enable_peer_access(device_index, remote_index)
            base, size = cuda_memory.allocation_range(region.ptr, remote_index)
            offset = region.ptr - base
        else:
            imports = self._imports[peer.key]
            mapping = imports.get((region.handle, device_index))
            if mapping is None:
                mapping = imports[(region.handle, device_index)] = cuda_memory.open_handle(
                    region.handle, device_index
                )
            base, size = mapping
            offset = region.offset
        real_bytes = min(region.num_bytes, size - offset)
        self._ptrs[cache_key] = (base + offset, real_bytes)
        return base + offset, real_bytes

    # -- transfers ------------------------------------------------------------------------------

    def _transfer(
        self, op: str, local: Local, peer: EngineDesc, remote_mem: MemoryDesc, plan: TransferPlan
    ) -> Transfer:
        device = local.tensor.device
        assert device.index is not None
        if remote_mem.epoch != peer.epoch:  # also here: callers may reach _transfer directly
            raise StaleDescriptor(
                f"region {remote_mem.mem_id} of {peer.key!r} is from epoch {remote_mem.epoch}, "
                f"the connected peer is epoch {peer.epoch}"
            )
        if not self._peer_alive(peer.key, thorough=False):
            raise PeerLost(f"peer {peer.key!r} (pid {self._peer_info[peer.key].pid}) has exited")
        remote_ptr, real_bytes = self._remote_region(peer, remote_mem, device.index)
        # the memory really mapped there, not what the descriptor claims (it may be forged or corrupt)
        what = f"region {remote_mem.mem_id} of {peer.key!r} as registered"
        if remote_mem.num_bytes > real_bytes:
            what += f" (its descriptor claims {remote_mem.num_bytes})"
        plan.check_remote(real_bytes, what)
        local_ptr = local.tensor.data_ptr()
        src, dst = (remote_ptr, local_ptr) if op == "read" else (local_ptr, remote_ptr)
        cfg = self.config.cuda_ipc
        seg = cuda_methods.describe(plan.sizes)
        method = cuda_methods.choose(
            cfg.method,
            seg,
            small_transfer_bytes=cfg.small_transfer_bytes,
            copy_engine_segment_bytes=cfg.copy_engine_segment_bytes,
        )
        lane = self._lane(device)
        after = local.after
        with lane.lock, cuda_driver.ContextGuard(lane.ctx):
            stream = lane.handle
            if after is None:  # after the work queued so far on the caller's current stream
                lane.order.record(self._current_stream(lane.index))
                cuda_driver.stream_wait(stream, lane.order)
            elif isinstance(after, torch.cuda.Event):
                lane.stream.wait_event(after)
            else:
                lane.stream.wait_stream(after)
            start = None
            if self.time_transfers:
                start = torch.cuda.Event(enable_timing=True)
                start.record(lane.stream)
            self._enqueue(lane, method, src, dst, plan.copy_for(op), seg)
            event: Event
            if self.time_transfers:
                timed = torch.cuda.Event(enable_timing=True)
                timed.record(lane.stream)
                event = timed
            else:
                raw = cuda_driver.RawEvent()
                raw.record(stream)
                event = raw
        transfer = CudaTransfer(
            seg.total_bytes, seg.num_segments, peer.key, event, lambda: self._peer_alive(peer.key), method
        )
        transfer.start_event = start
        with self._lock:
            inflight = self._inflight.setdefault(peer.key, collections.deque())
            while inflight and inflight[0].done():  # one stream per GPU: they mostly end in order
                inflight.popleft()
            inflight.append(transfer)
        return transfer

    @staticmethod
    def _enqueue(
        lane: _Lane, method: str, src: int, dst: int, copy: Copy, seg: cuda_methods.Segments
    ) -> None:
        """Put the copy on the lane's stream by ``method`` (the lane's lock and context are held)."""
        if method == cuda_methods.KERNEL:
            lane.copier.copy(src, dst, copy, seg)
        elif method == cuda_methods.COPY_ENGINE:
            lane.engine.copy(src, dst, copy, lane.handle)
        elif method == cuda_methods.MEMCPY:
            lane.engine.copy_each(src, dst, copy, lane.handle)

    def tune(
        self,
        *,
        method: str | None = None,
        variant: KernelVariant | None = None,
        max_ctas: int | None = None,
        prefer_overlap: bool | None = None,
        batch: bool | None = None,
    ) -> None:
        """Benchmarks and tests: change how later transfers move, on every GPU of this agent.

        ``method`` and ``max_ctas`` as in ``transfer.cuda_ipc``; ``variant``: the kernel's launch
        shape; ``prefer_overlap``/``batch``: the copy-engine submitter's hint and batch switch.
        """
        with self._lock:
            changes: dict[str, Any] = {}
            if method is not None:
                changes["method"] = method
            if max_ctas is not None:
                changes["max_ctas"] = max_ctas
            if changes:
                cuda_cfg = msgspec.structs.replace(self.config.cuda_ipc, **changes)
                self.config = msgspec.structs.replace(self.config, cuda_ipc=cuda_cfg)
            if variant is not None:
                self.kernel_variant = variant
            if prefer_overlap is not None:
                self._engine_options["prefer_overlap"] = prefer_overlap
            if batch is not None:
                self._engine_options["batch"] = batch
            for index, lane in self._lanes.items():
                with lane.lock, torch.cuda.device(index):
                    device, cap = torch.device("cuda", index), self.config.cuda_ipc.max_ctas
                    lane.copier = SegmentCopier(device, lane.stream, self.kernel_variant, max_ctas=cap)
                    lane.engine = CopyEngine(index, **self._engine_options)

    def copy_engine_mode(self, device: torch.device | int) -> tuple[str, str]:
        """(how the copy engines get their segments on a local GPU, why not as a batch if not)."""
        engine = self._lane(torch.device("cuda", device) if isinstance(device, int) else device).engine
        return engine.mode, engine.reason

    def _close(self) -> None:
        for lane in self._lanes.values():
            lane.stream.synchronize()
        self._lanes.clear()
