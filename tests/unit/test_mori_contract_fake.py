"""The whole transfer-agent contract suite on the mori backend, with a FAKE ``mori`` on CPU memory.

The fake (``tests/unit/fake_mori.py``) stands in for ``mori.io`` because there is no AMD hardware
here and the real ``amd-mori`` wheels are cp310/ROCm only. It copies bytes between CPU tensors,
so this checks the adapter's logic (bounds, epochs, sessions, holds, disconnects), not MoRI.
The real thing runs in ``tests/rocm/test_contract_mori.py`` where a ROCm GPU and ``mori`` exist.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import fake_mori  # tests/unit is on sys.path under pytest (no __init__.py here)
import pytest

from moriio_ray.transfer import TransferAgent
from tests.contract.harness import Harness
from tests.contract.suite import ContractSuite

_IN_PROCESS_ONLY = "the fake mori lives in this process; a spawned peer process cannot reach it"


class FakeMoriHarness(Harness):
    """mori on the fake: CPU memory, holds on the caller's side, no peer processes."""

    backend = "mori"
    device = "cpu"
    hold_side = "client"
    no_peer_process = _IN_PROCESS_ONLY

    def make_agent(
        self, key: str, epoch: int = 1, token: bytes | None = None, **config: Any
    ) -> TransferAgent:
        agent = fake_mori.cpu_agent_class()(self.config(**config), key, epoch=epoch, token=token)
        self._agents.append(agent)
        return agent


@pytest.fixture
def harness(monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    fake_mori.install(monkeypatch)
    with FakeMoriHarness() as h:
        yield h


class TestContractFakeMori(ContractSuite):
    """The whole suite; the two tests that need a peer in another process skip with the reason."""
