"""The backend contract suite (tests/contract) on cuda_ipc: every transfer method, on two GPUs and on
one GPU (peer processes map the memory through IPC handles either way).

- ``two-gpus``: this process's agents on GPU 0, the peers (``prefill-*`` agents here and peer
  processes) on GPU 1, so reads pull across NVLink and writes push across it.
- ``one-gpu``: everything on GPU 0.
- Each runs with ``transfer.cuda_ipc.method`` set to every method the agent can choose
  (``kernel``, ``copy_engine``, ``memcpy``, and ``auto``, which picks among them by size).

The three mid-transfer tests need a hook that parks a copy half-way; a single kernel launch has
none, so they skip (tests/gpu/test_cuda_ipc_procs.py kills a peer while a copy is queued instead).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from moriio_ray.config import CUDA_IPC_METHODS, CudaIpcConfig
from moriio_ray.transfer import MemoryDesc, TransferAgent
from tests.contract.harness import Harness, PeerProcess
from tests.contract.suite import ContractSuite


class CudaIpcHarness(Harness):
    """cuda_ipc with this side's memory on ``device`` and the peers' on ``peer_device``."""

    backend = "cuda_ipc"
    device: ClassVar[str] = "cuda:0"
    peer_device: ClassVar[str] = "cuda:0"
    hold_side = None

    def region(
        self, agent: TransferAgent, num_bytes: int, seed: int | None = None
    ) -> tuple[torch.Tensor, MemoryDesc]:
        if agent.key.startswith("prefill"):
            return self._on(self.peer_device, super().region, agent, num_bytes, seed)
        return super().region(agent, num_bytes, seed)

    def spawn_peer(self, key: str, num_bytes: int, **kwargs: Any) -> PeerProcess:
        return self._on(self.peer_device, super().spawn_peer, key, num_bytes, **kwargs)

    def _on(self, device: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.device = device  # type: ignore[misc]  # an instance value shadows the class one
        try:
            return fn(*args, **kwargs)
        finally:
            del self.device


class TwoGpus(CudaIpcHarness):
    peer_device = "cuda:1"


def _with_method(base: type[CudaIpcHarness], method: str) -> type[CudaIpcHarness]:
    """``base`` with every agent (here and in peer processes) configured for ``method``."""
    overrides = {"cuda_ipc": CudaIpcConfig(method=method)}
    return type(f"{base.__name__}_{method}", (base,), {"config_overrides": overrides})


@pytest.fixture(
    params=[
        pytest.param(_with_method(cls, method), id=f"{name}-{method}", marks=mark)
        for method in CUDA_IPC_METHODS
        for cls, name, mark in (
            (TwoGpus, "two-gpus", pytest.mark.gpu(min_gpus=2)),
            (CudaIpcHarness, "one-gpu", pytest.mark.gpu),
        )
    ]
)
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    with request.param() as h:
        yield h


class TestContractCudaIpc(ContractSuite):
    pass
