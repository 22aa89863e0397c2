"""The transfer backends' own config sections: ``transfer.tcp``, ``transfer.mori``, ``transfer.cuda_ipc``."""

from __future__ import annotations

import msgspec

from moriio_ray.config_checks import STRUCT as _STRUCT
from moriio_ray.config_checks import at_least as _at_least
from moriio_ray.config_checks import choice as _choice
from moriio_ray.config_checks import positive as _positive
from moriio_ray.errors import ConfigError


class TcpConfig(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """The tcp backend's server and client."""

    port: int = 0  # 0: an ephemeral port, published through the descriptor (no port arithmetic)
    bind_host: str = "0.0.0.0"
    connect_timeout_s: float = 5.0
    staging_bytes: int = 64 << 20  # pinned host buffer through which GPU tensors are staged
    socket_buffer_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: {self.port!r} must be in 0..65535")
        _positive(self, "connect_timeout_s")
        _at_least(self, "staging_bytes", 1 << 20)
        _at_least(self, "socket_buffer_bytes", 1 << 16)


class MoriConfig(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """MoRI-IO, with the knobs that vLLM's MoRIIO connector exposes."""

    backend: str = "rdma"  # rdma | xgmi, case-insensitive as in MoRIIO
    qp_per_transfer: int = 1
    post_batch_size: int = -1  # -1: MoRI's default
    num_workers: int = 1
    poll_cq_mode: str = "polling"  # polling | event
    enable_notification: bool = False  # off: notification OOM errors poisoned statuses in vLLM
    xgmi_num_streams: int = 64
    xgmi_num_events: int = 64

    def __post_init__(self) -> None:
        _choice(self, "backend", ("rdma", "xgmi"))
        _at_least(self, "qp_per_transfer", 1)
        _at_least(self, "post_batch_size", 1, allow=(-1,))
        _at_least(self, "num_workers", 1)
        _choice(self, "poll_cq_mode", ("polling", "event"))
        _at_least(self, "xgmi_num_streams", 1)
        _at_least(self, "xgmi_num_events", 1)


CUDA_IPC_METHODS = ("auto", "kernel", "copy_engine", "memcpy")


class CudaIpcConfig(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """The cuda_ipc backend (NVIDIA GPUs of one host).

    ``method`` picks how a transfer's segments move (``transfer/cuda_methods.py``):
    ``kernel`` (one SM gather/scatter launch), ``copy_engine`` (one ``cuMemcpyBatchAsync`` on the
    copy engines), ``memcpy`` (one ``cuMemcpyAsync`` per segment), or ``auto`` (by size, below).
    """

    method: str = "auto"  # auto | kernel | copy_engine | memcpy
    # auto: below this many bytes per transfer one memcpy per segment beats the kernel launch
    small_transfer_bytes: int = 64 << 10  # measured on H200: copies win below ~2 segments of 32 KiB
    # auto: segments of at least this many bytes on average go to the copy engines
    copy_engine_segment_bytes: int = 1 << 20
    max_ctas: int = 0  # copy-kernel CTAs; 0: as many as fit on the GPU at once

    def __post_init__(self) -> None:
        _choice(self, "method", CUDA_IPC_METHODS)
        _at_least(self, "small_transfer_bytes", 0)
        _at_least(self, "copy_engine_segment_bytes", 1)
        _at_least(self, "max_ctas", 0)
