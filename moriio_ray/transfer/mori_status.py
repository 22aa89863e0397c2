"""MoRI transfer statuses: waiting on them with a deadline, and mapping MoRI's failures to our errors.

A MoRI ``TransferStatus`` is written by MoRI's C++ threads through a raw pointer until it is
terminal (``Succeeded()`` or ``Failed()``), so a ``MoriTransfer`` keeps its statuses, and whatever
else the call handed to C++, referenced until then; the agent keeps a failed-over transfer alive
the same way after its caller has let go of it.

Waiting is ``IOEngine.wait_all(statuses, timeout_ms)`` (amd-mori 1.2.4 has it; it releases the GIL),
in slices, so that a peer failure that MoRI reports (``pop_peer_failure``, a session no longer
``alive()``) or a disconnect ends a blocked wait within one slice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from moriio_ray.errors import PeerLost, SegmentOutOfBounds, TransferError, TransferTimeout
from moriio_ray.transfer.handle import Transfer

# Waits up to timeout_s for every status to be terminal; returns early when they are.
Waiter = Callable[[Sequence[Any], float], None]

# Longest single native wait, so that a disconnect or a peer failure (PeerLost) reaches a blocked
# waiter quickly.
_WAIT_SLICE_S = 0.05

# MoRI StatusCode names -> (our error, what it means). Every name here is checked against the real
# StatusCode members by tests/unit/test_mori_surface.py; an unlisted failure is a TransferError.
_STATUS_ERRORS: dict[str, tuple[type[TransferError], str]] = {
    "ERR_INVALID_ARGS": (
        SegmentOutOfBounds,
        "MoRI refused the segments (an offset or size outside a registered region)",
    ),
    "ERR_NOT_FOUND": (
        PeerLost,
        "the peer's engine or region is no longer registered (it restarted or deregistered); "
        "reconnect with its current descriptor",
    ),
    "ERR_RDMA_OP": (
        TransferError,
        "an RDMA operation failed; check the NICs and their queue depths, or lower "
        "transfer.mori.qp_per_transfer or the number of concurrent requests",
    ),
    "ERR_BAD_STATE": (TransferError, "the MoRI engine is in a bad state; restart this engine"),
    "ERR_GPU_OP": (
        TransferError,
        "a GPU (HIP) copy failed; check the ROCm driver and peer access between the GPUs",
    ),
}
MAPPED_STATUS_CODES = frozenset(_STATUS_ERRORS)
_UNLISTED = (TransferError, "see MoRI's log (mori.io.set_log_level) for details")


def code_name(code: Any) -> str:
    """``ERR_RDMA_OP`` for ``StatusCode.ERR_RDMA_OP`` (a pybind11 enum or any enum)."""
    name = getattr(code, "name", None)
    if isinstance(name, str) and name:
        return name
    return str(code).rsplit(".", 1)[-1]


def is_terminal(status: Any) -> bool:
    return bool(status.Succeeded() or status.Failed())


def status_error(status: Any, peer_key: str) -> TransferError:
    """Our error for a failed status (``_STATUS_ERRORS``), carrying MoRI's code and message."""
    name = code_name(status.Code())
    message = status.Message() or "no message"
    error, meaning = _STATUS_ERRORS.get(name, _UNLISTED)
    return error(f"MoRI transfer with {peer_key!r} failed with {name}: {message}; {meaning}")


def peer_failure_error(event: Any, peer_key: str | None) -> TransferError:
    """Our error for a ``PeerFailureEvent``: PeerLost for a named peer, TransferError for a local fault.

    ``peer_key`` is our key of the peer whose MoRI engine the event names (None: it names none).
    """
    reason = code_name(event.reason)
    where = f"device {event.device_name or '?'} port {event.port_num} qp {event.qp_num}"
    detail = event.detail or "no detail"
    if peer_key is None:
        return TransferError(
            f"MoRI reported {reason} on {where} ({detail}) for no particular peer; every in-flight "
            "transfer of this engine failed; check this host's RDMA NIC, its port and its driver"
        )
    return PeerLost(
        f"MoRI reported {reason} for peer {peer_key!r} (MoRI engine {event.remote_engine_key!r}, "
        f"{where}: {detail}); its in-flight transfers failed at once; the coordinator replaces a dead "
        "peer, or reconnect it once it is back"
    )


def _timeout_ms(timeout_s: float) -> int:
    # MoRI reads -1 as "forever"; never hand it 0 or a negative slice by rounding.
    return max(1, int(timeout_s * 1000))


def make_waiter(engine: Any) -> Waiter:
    """A timed wait on a list of statuses through ``engine.wait_all``."""

    def wait_on_engine(statuses: Sequence[Any], timeout_s: float) -> None:
        engine.wait_all(list(statuses), _timeout_ms(timeout_s))

    return wait_on_engine


class MoriTransfer(Transfer):
    """One batched MoRI read or write. Holds its statuses and the call's buffers until terminal.

    ``deadline_s`` (``transfer.timeout_s`` after issue) ends it with TransferTimeout even if MoRI
    never reports a completion, so a lost completion cannot hang a request. ``poll`` is the agent's
    check for peer failures; ``done()`` (and so every wait slice) calls it.
    """

    def __init__(
        self,
        *,
        num_bytes: int,
        num_segments: int,
        peer_key: str,
        waiter: Waiter,
        deadline_s: float,
        poll: Callable[[], None],
    ) -> None:
        self.deadline_s = deadline_s  # a time.monotonic() value
        self._limit_s = deadline_s - time.monotonic()
        self.statuses: list[Any] = []
        self.keepalive: list[tuple[Any, ...]] = []  # per batch: the session and the lists given to C++
        self.num_bytes = num_bytes
        self.num_segments = num_segments
        self.peer_key = peer_key
        self._waiter = waiter
        self._poll = poll
        self._lock = threading.Lock()
        self._forced: TransferError | None = None
        self._peer_lost: PeerLost | None = None  # explains a status that MoRI fails after it
        self._issued = threading.Event()  # set by finish_issuing once every batch is out

    def add_batch(self, status: Any, keepalive: tuple[Any, ...]) -> None:
        """Attach an issued batch's status and everything the C++ side may point at."""
        with self._lock:
            self.keepalive.append(keepalive)
            self.statuses.append(status)

    def finish_issuing(self) -> None:
        self._issued.set()

    @property
    def forced_error(self) -> TransferError | None:
        return self._forced

    def fail(self, error: TransferError) -> None:
        """Fail the transfer from our side (its peer was disconnected, or MoRI reported it lost); MoRI
        may still complete it. A PeerLost is kept either way, to explain a status MoRI fails later."""
        with self._lock:
            if isinstance(error, PeerLost) and self._peer_lost is None:
                self._peer_lost = error
            if self._forced is None and not self.statuses_terminal():
                self._forced = error

    def statuses_terminal(self) -> bool:
        return self._issued.is_set() and all(is_terminal(s) for s in self.statuses)

    def sessions_alive(self) -> bool:
        """False once MoRI says a session this transfer was issued on is dead (a failed queue pair)."""
        with self._lock:
            sessions = [batch[0] for batch in self.keepalive]
        return all(session.alive() for session in sessions)

    def _check_deadline(self) -> None:
        if self._forced is None and time.monotonic() >= self.deadline_s:
            self.fail(
                TransferTimeout(
                    f"MoRI transfer of {self.num_bytes} bytes in {self.num_segments} segments with "
                    f"{self.peer_key!r} did not finish within its deadline (transfer.timeout_s = "
                    f"{self._limit_s:.3g} s); check the link to the peer, or raise transfer.timeout_s"
                )
            )

    def done(self) -> bool:
        if self._forced is None and not self.statuses_terminal():
            self._poll()
        self._check_deadline()
        return self._forced is not None or self.statuses_terminal()

    def error(self) -> BaseException | None:
        if self._forced is not None:
            return self._forced
        if not self.statuses_terminal():
            return None
        for status in self.statuses:
            if status.Failed():
                return self._explain(status_error(status, self.peer_key))
        return None

    def _explain(self, error: TransferError) -> TransferError:
        """A generic MoRI failure (ERR_RDMA_OP, ...) on a connection to a lost peer is PeerLost: a killed
        peer shows up as a failed queue pair, and callers must be able to tell it from a bad request."""
        if type(error) is not TransferError:
            return error
        self._poll()
        if self._peer_lost is None and self.sessions_alive():
            return error
        why = self._peer_lost or "MoRI's session to it is no longer alive (a queue pair to it failed)"
        return PeerLost(f"{error}; the peer is lost: {why}")

    def wait(self, timeout_s: float | None = None) -> None:
        caller_deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.done():
            now = time.monotonic()
            if caller_deadline_s is not None and now >= caller_deadline_s:
                raise self.wait_timeout(timeout_s, "; it goes on until its deadline (transfer.timeout_s)")
            end_s = self.deadline_s if caller_deadline_s is None else min(self.deadline_s, caller_deadline_s)
            slice_s = max(0.0, min(end_s - now, _WAIT_SLICE_S))
            if self._issued.is_set():
                self._waiter(self.statuses, slice_s)
            else:
                self._issued.wait(slice_s)
        error = self.error()
        if error is not None:
            raise error
