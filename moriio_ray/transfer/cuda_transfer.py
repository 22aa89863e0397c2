"""The cuda_ipc Transfer handle: completion is one CUDA event recorded after the copy."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Protocol

import torch

from moriio_ray.errors import PeerLost
from moriio_ray.transfer.handle import Transfer

# How often a waiting transfer asks whether its peer process still lives.
LIVENESS_PERIOD_S = 0.05
# Polls that only yield the GIL before the waiter starts to sleep between polls.
SPIN_POLLS = 2000
POLL_SLEEP_S = 50e-6


def pid_alive(pid: int, *, zombie_is_dead: bool = True) -> bool:
    """Whether process ``pid`` (in this PID namespace) exists (and, by default, is not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not zombie_is_dead:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no procfs here: trust kill(0)
    return state not in (b"Z", b"X")


class Event(Protocol):
    """A recorded CUDA event: ``cuda_driver.RawEvent`` (the fast path) or ``torch.cuda.Event`` (timed)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class CudaTransfer(Transfer):
    """A batch copy in flight on the agent's copy stream.

    ``done()`` queries the event; ``wait(timeout_s)`` polls that event (never a device-wide
    synchronize) and raises TransferTimeout after ``timeout_s``, the copy going on. A transfer whose
    peer was disconnected, or whose peer process died while it was waited on, fails with PeerLost.
    """

    def __init__(
        self,
        num_bytes: int,
        num_segments: int,
        peer_key: str,
        event: Event,
        peer_alive: Callable[[], bool],
        method: str = "",
    ) -> None:
        self.num_bytes = num_bytes
        self.num_segments = num_segments
        self.peer_key = peer_key
        self.event = event
        self.method = method  # kernel | copy_engine | memcpy | none: how the segments moved
        self._peer_alive = peer_alive
        self._error: BaseException | None = None
        self._done = False  # the event was seen complete (it stays so)
        self.start_event: torch.cuda.Event | None = None  # set when the agent times transfers

    def _complete(self) -> bool:
        if not self._done and self.event.query():
            self._done = True
        return self._done

    def fail(self, error: BaseException) -> None:
        """Mark the transfer failed (the copy may still run; its bytes are not to be trusted)."""
        if self._error is None:
            self._error = error

    def done(self) -> bool:
        return self._error is not None or self._complete()

    def error(self) -> BaseException | None:
        return self._error

    def wait(self, timeout_s: float | None = None) -> None:
        start = time.monotonic()
        deadline = None if timeout_s is None else start + timeout_s
        next_check = start + LIVENESS_PERIOD_S
        polls = 0
        while True:
            if self._error is not None:
                raise self._error
            if self._complete():
                if self._error is not None:
                    raise self._error
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise self.wait_timeout(
                    timeout_s, "; raise transfer.timeout_s or check what the copy stream waits on"
                )
            if now >= next_check:
                next_check = now + LIVENESS_PERIOD_S
                if not self._peer_alive():
                    self.fail(
                        PeerLost(f"peer {self.peer_key!r} exited while a transfer with it was in flight")
                    )
                    continue
            polls += 1
            if polls < SPIN_POLLS:
                time.sleep(0)
            else:
                left = POLL_SLEEP_S if deadline is None else max(0.0, min(POLL_SLEEP_S, deadline - now))
                time.sleep(left)
