"""The transfer-agent contract suite on the real ``mori`` backend (AMD GPUs, ``amd-mori``), rdma and xgmi.

Collected everywhere; skipped with the reason below unless ``mori.io`` imports and a ROCm GPU is
present. Memory lives on GPU 0; the suite's peers run in this process (two IOEngines, as MoRI's own
tests do) and, for the peer-process tests, in a spawned child.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from moriio_ray.config import MoriConfig
from moriio_ray.errors import BackendUnavailable
from tests.contract.harness import Harness
from tests.contract.suite import ContractSuite

REASON = "needs mori (amd-mori) and a ROCm GPU"


def _has_mori_and_rocm_gpu() -> bool:
    try:
        importlib.import_module("mori.io")
    except (ImportError, OSError):
        return False
    return torch.version.hip is not None and torch.cuda.is_available()


pytestmark = [pytest.mark.rocm, pytest.mark.skipif(not _has_mori_and_rocm_gpu(), reason=REASON)]


class MoriRdmaHarness(Harness):
    backend = "mori"
    device = "cuda:0"  # ROCm PyTorch calls HIP devices "cuda"
    hold_side = "client"  # HoldingMoriAgent (tests/contract/hooks.py) parks the rest on the caller's side
    config_overrides: ClassVar[dict[str, Any]] = {"mori": MoriConfig(backend="rdma")}


class MoriXgmiHarness(MoriRdmaHarness):
    config_overrides: ClassVar[dict[str, Any]] = {"mori": MoriConfig(backend="xgmi")}


@pytest.fixture(params=[MoriRdmaHarness, MoriXgmiHarness], ids=["rdma", "xgmi"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    with request.param() as h:
        try:
            h.make_agent("probe")
        except BackendUnavailable as exc:
            pytest.skip(f"MoRI cannot start this backend here: {exc}")
        yield h


class TestContractMori(ContractSuite):
    """The mori backend passes the whole contract on AMD GPUs."""
