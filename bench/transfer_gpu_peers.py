"""The peers in ``transfer_gpu_bench.py``: NIXL (UCX) and Mooncake's transfer engine, as backends
of ``transfer_gpu_worker.Worker`` (same workload, same checks, same host timing as cuda_ipc).

- **NIXL** (``nixl-cu13``): UCX backend, with ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` (READ falls back to
  TCP without it) and ``NIXL_UCX_SGL_ENABLE=1``. Two timings per case: ``create`` builds the
  descriptor lists and the request for every transfer (what a server does per request), ``repost``
  posts one prepared request again (NIXL's best case).
- **Mooncake** (``mooncake-transfer-engine-cuda13``): protocol ``nvlink_intra`` with
  ``MC_INTRANODE_NVLINK=1``, P2P handshake (no metadata server), ``batch_transfer_sync_*_arrays``.

The settings go into the environment before the libraries load (``PEER_ENV``); ``transports`` picks
the lines of a worker's log that name the transport really used.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.transfer_gpu_cases import Case

PEER_ENV: dict[str, dict[str, str]] = {
    "nixl": {
        "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
        "NIXL_UCX_SGL_ENABLE": "1",
        "UCX_PROTO_INFO": "y",  # prints the protocol (and transport) chosen per operation
        "UCX_LOG_LEVEL": "info",
        "NIXL_LOG_LEVEL": "INFO",
    },
    "mooncake": {"MC_INTRANODE_NVLINK": "1", "GLOG_v": "1", "GLOG_logtostderr": "1"},
}
TRANSPORT_WORDS = re.compile(
    r"cuda_ipc|cuda_copy|nvlink|intra|tcp|rc_mlx5|rc_verbs|dc_mlx5|ud_|sysv|posix|cma|gdr|rdma|transport",
    re.IGNORECASE,
)


def set_env(names: list[str]) -> dict[str, str]:
    """Export the peers' settings (before their libraries load); returns what was set."""
    done = {}
    for name in names:
        for k, v in PEER_ENV.get(name, {}).items():
            os.environ[k] = v  # the benchmark's child processes only; the library reads them at load
            done[k] = v
    return done


def transports(log: Path, limit: int = 40) -> list[str]:
    """The log lines that name a transport (deduplicated, in order)."""
    if not log.exists():
        return []
    seen: dict[str, None] = {}
    for line in log.read_text(errors="replace").splitlines():
        if TRANSPORT_WORDS.search(line):
            seen.setdefault(line.strip()[:240], None)
            if len(seen) >= limit:
                break
    return list(seen)


class _Done:
    """A finished synchronous transfer (the peers' sync calls return when the bytes are there)."""

    def wait(self, timeout_s: float | None = None) -> None:
        return None


class _NixlTransfer:
    def __init__(self, agent: Any, handle: Any, release: bool) -> None:
        self.agent, self.handle, self.release = agent, handle, release

    def wait(self, timeout_s: float | None = None) -> None:
        state = self.agent.transfer(self.handle)
        deadline = time.monotonic() + (timeout_s or 300.0)
        while state == "PROC":
            if time.monotonic() > deadline:
                raise TimeoutError("NIXL transfer did not finish")
            state = self.agent.check_xfer_state(self.handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer state {state}")
        if self.release:
            self.agent.release_xfer_handle(self.handle)


class NixlBackend:
    name = "nixl"

    def __init__(self, role: str, device: int, cache: torch.Tensor) -> None:
        try:
            import nixl_cu13 as nixl
        except ImportError:
            from nixl import _api as nixl  # the meta package's layout
        self.nixl = nixl
        self.device = device
        self.agent = nixl.nixl_agent(f"bench-{role}", nixl.nixl_agent_config(backends=["UCX"]))
        self.agent.register_memory(cache)
        self.base = cache.data_ptr()
        self.desc = (self.agent.get_agent_metadata(), self.base, device)
        self.remote = ""
        self.peer_base = self.peer_device = 0
        self.backend_used = ""

    def connect(self, peer: Any) -> None:
        meta, self.peer_base, self.peer_device = peer
        self.remote = self.agent.add_remote_agent(meta)
        if hasattr(self.agent, "make_connection"):
            self.agent.make_connection(self.remote)

    def _descs(self, c: Case, op: str) -> tuple[Any, Any]:
        local_off, remote_off = (c.d_off, c.p_off) if op == "read" else (c.p_off, c.d_off)
        sizes = c.sizes.astype(np.uint64)
        local = np.stack(
            [self.base + local_off.astype(np.uint64), sizes, np.full_like(sizes, self.device)], 1
        )
        far = np.stack(
            [self.peer_base + remote_off.astype(np.uint64), sizes, np.full_like(sizes, self.peer_device)], 1
        )
        return self.agent.get_xfer_descs(local, "VRAM"), self.agent.get_xfer_descs(far, "VRAM")

    def prepare(self, op: str, c: Case, variant: dict[str, Any]) -> Any:
        kind = "READ" if op == "read" else "WRITE"
        if variant.get("mode") == "repost":
            local, far = self._descs(c, op)
            handle = self.agent.initialize_xfer(kind, local, far, self.remote)
            self.backend_used = self.agent.query_xfer_backend(handle)
            return lambda: _NixlTransfer(self.agent, handle, release=False)

        def create() -> _NixlTransfer:
            local, far = self._descs(c, op)
            return _NixlTransfer(self.agent, self.agent.initialize_xfer(kind, local, far, self.remote), True)

        return create

    def info(self) -> dict[str, Any]:
        return {"backend": self.backend_used, "version": getattr(self.nixl, "__version__", "")}

    def close(self) -> None:
        pass


class MooncakeBackend:
    name = "mooncake"

    def __init__(self, role: str, device: int, cache: torch.Tensor) -> None:
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        rc = self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink_intra", "")
        if rc != 0:
            raise RuntimeError(f"Mooncake initialize(nvlink_intra) returned {rc}")
        self.base = cache.data_ptr()
        for location in (f"cuda:{device}", "*"):  # "*": let Mooncake find where the memory is
            rc = self.engine.register_memory(self.base, cache.numel(), location)
            if rc == 0:
                break
        else:
            raise RuntimeError(f"Mooncake register_memory returned {rc}")
        self.desc = (f"127.0.0.1:{self.engine.get_rpc_port()}", self.base)
        self.target = ""
        self.peer_base = 0

    def connect(self, peer: Any) -> None:
        self.target, self.peer_base = peer

    def prepare(self, op: str, c: Case, variant: dict[str, Any]) -> Any:
        local_off, remote_off = (c.d_off, c.p_off) if op == "read" else (c.p_off, c.d_off)
        call = (
            self.engine.batch_transfer_sync_read_arrays
            if op == "read"
            else self.engine.batch_transfer_sync_write_arrays
        )
        sizes = c.sizes.astype(np.uint64)

        def run() -> _Done:
            local = (self.base + local_off).astype(np.uint64)
            far = (self.peer_base + remote_off).astype(np.uint64)
            rc = call(self.target, local, far, sizes)
            if rc != 0:
                raise RuntimeError(f"Mooncake batch transfer returned {rc}")
            return _Done()

        return run

    def info(self) -> dict[str, Any]:
        return {"protocol": "nvlink_intra"}

    def close(self) -> None:
        self.engine.unregister_memory(self.base)


def make_peer_backend(name: str, role: str, device: int, cache: torch.Tensor) -> Any:
    if name == "nixl":
        return NixlBackend(role, device, cache)
    if name == "mooncake":
        return MooncakeBackend(role, device, cache)
    raise ValueError(f"unknown peer {name!r}")
