"""Test doubles built on the real backends: agents that can park a transfer mid-way through its
data, and tcp forced through its GPU staging path on CPU memory.

The production classes carry no test hooks; they call a no-op progress method
(``ShmAgent._on_copied``, ``TcpServer._on_moved``) or issue through a seam
(``MoriAgent._issue_segments``) that these subclasses override.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from moriio_ray.config import TransferConfig
from moriio_ray.errors import TransferError
from moriio_ray.transfer import TransferAgent, create_agent
from moriio_ray.transfer.mori import MoriAgent
from moriio_ray.transfer.mori_status import MoriTransfer, is_terminal
from moriio_ray.transfer.plan import TransferPlan
from moriio_ray.transfer.shm import ShmAgent
from moriio_ray.transfer.tcp import TcpAgent
from moriio_ray.transfer.tcp_region import make_region
from moriio_ray.transfer.tcp_server import TcpServer

HOLD_MAX_S = 60.0  # a hold never parks a thread longer than this
HOLD_POLL_S = 0.05


class Parking:
    """Parks the first progress report that reaches ``after_bytes`` until ``release`` is set."""

    def __init__(self) -> None:
        self.after_bytes: int | None = None
        self.held = threading.Event()
        self.release = threading.Event()

    def arm(self, after_bytes: int) -> tuple[threading.Event, threading.Event]:
        self.held.clear()
        self.release.clear()
        self.after_bytes = after_bytes
        return self.held, self.release

    def check(self, moved_bytes: int) -> None:
        limit = self.after_bytes
        if limit is not None and moved_bytes >= limit:
            self.after_bytes = None
            self.held.set()
            self.release.wait(HOLD_MAX_S)


class HoldingShmAgent(ShmAgent):
    """shm whose next asynchronous copy (1 MiB or more) parks once ``hold_after`` bytes moved."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parking = Parking()

    def hold_after(self, num_bytes: int) -> tuple[threading.Event, threading.Event]:
        return self.parking.arm(num_bytes)

    def _on_copied(self, moved_bytes: int) -> None:
        self.parking.check(moved_bytes)

    def _close(self) -> None:
        self.parking.release.set()  # a parked copy must not outlive the agent
        super()._close()


class HoldingTcpServer(TcpServer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.parking = Parking()
        super().__init__(*args, **kwargs)

    def _on_moved(self, moved_bytes: int) -> None:
        self.parking.check(moved_bytes)

    def close(self) -> None:
        self.parking.release.set()
        super().close()


class HoldingTcpAgent(TcpAgent):
    """tcp whose server parks the next request it serves once ``hold_after`` bytes moved."""

    server_class = HoldingTcpServer

    def hold_after(self, num_bytes: int) -> tuple[threading.Event, threading.Event]:
        server = self._server
        assert isinstance(server, HoldingTcpServer)
        return server.parking.arm(num_bytes)


class StagingTcpAgent(HoldingTcpAgent):
    """tcp that sends CPU regions through the GPU staging path (windows, gathers, scatters)."""

    def _register(self, mem_id: int, tensor: torch.Tensor) -> bytes:
        self._io[mem_id] = make_region(tensor, self.config.tcp.staging_bytes, force_staging=True)
        return b""


def _split_at(sizes: np.ndarray, num_bytes: int) -> int:
    """How many leading segments hold the first ``num_bytes`` (at least one, and one left if any)."""
    first = int(np.searchsorted(np.cumsum(sizes), num_bytes)) + 1
    return max(1, min(first, int(sizes.size) - 1)) if sizes.size > 1 else 1


class HoldingMoriAgent(MoriAgent):
    """mori whose next transfer issues the segments holding its first ``hold_after`` bytes, waits
    for them, sets ``held`` and parks (on the caller's side: MoRI moves data without the owner)
    until ``release`` is set; then it issues the rest."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hold: tuple[int, threading.Event, threading.Event] | None = None

    def hold_after(self, num_bytes: int) -> tuple[threading.Event, threading.Event]:
        held, release = threading.Event(), threading.Event()
        self._hold = (num_bytes, held, release)
        return held, release

    def _issue_segments(self, transfer: MoriTransfer, session: Any, op: str, plan: TransferPlan) -> bool:
        hold, self._hold = self._hold, None
        if hold is None:
            return super()._issue_segments(transfer, session, op, plan)
        first = _split_at(plan.sizes, hold[0])
        head, rest = _part(plan, slice(first)), _part(plan, slice(first, None))
        self._issue_batch(transfer, session, op, head)
        threading.Thread(
            target=self._issue_held_rest, args=(transfer, session, op, rest, hold), daemon=True
        ).start()
        return False

    def _issue_held_rest(
        self,
        transfer: MoriTransfer,
        session: Any,
        op: str,
        rest: TransferPlan,
        hold: tuple[int, threading.Event, threading.Event],
    ) -> None:
        _, held, release = hold
        try:
            while transfer.forced_error is None and not all(is_terminal(s) for s in transfer.statuses):
                self._waiter(transfer.statuses, HOLD_POLL_S)
                transfer.done()  # checks the deadline and MoRI's peer failures
            held.set()
            release.wait(HOLD_MAX_S)
            with self._lock:
                if transfer.forced_error is None and not self._closed and rest.num_segments:
                    self._issue_batch(transfer, session, op, rest)
        except Exception as exc:
            transfer.fail(TransferError(f"issuing the held rest of a transfer failed: {exc!r}"))
        finally:
            transfer.finish_issuing()


def _part(plan: TransferPlan, part: slice) -> TransferPlan:
    return TransferPlan(plan.local_offsets[part], plan.remote_offsets[part], plan.sizes[part])


_HOLDING: dict[str, type[TransferAgent]] = {
    "shm": HoldingShmAgent,
    "tcp": HoldingTcpAgent,
    "mori": HoldingMoriAgent,
}


def make_test_agent(
    config: TransferConfig, key: str, *, epoch: int = 1, token: bytes | None = None, staged: bool = False
) -> TransferAgent:
    """The backend's agent, as a holding test double where the backend has one."""
    cls = StagingTcpAgent if staged else _HOLDING.get(config.backend)
    if cls is None:
        return create_agent(config, key, epoch=epoch, token=token)
    return cls(config, key, epoch=epoch, token=token)
