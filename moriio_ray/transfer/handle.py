"""Transfer handles: what ``read``/``write`` return at once, before the data has moved."""

from __future__ import annotations

import abc
import threading

from moriio_ray.errors import TransferTimeout


class Transfer(abc.ABC):
    """A transfer in flight. ``wait`` raises TransferTimeout, TransferError or PeerLost."""

    num_bytes: int
    num_segments: int
    peer_key: str

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the transfer has finished, well or badly (``wait`` then returns or raises at once)."""

    @abc.abstractmethod
    def wait(self, timeout_s: float | None = None) -> None:
        """Block until finished. Raises TransferTimeout after ``timeout_s``; the transfer goes on."""

    @property
    def bytes_moved(self) -> int:
        """Bytes moved so far; ``num_bytes`` once finished well."""
        return self.num_bytes if self.done() and self.error() is None else 0

    def error(self) -> BaseException | None:
        """The failure, once done; None while running or after success."""
        return None

    def wait_timeout(self, timeout_s: float | None, hint: str = "") -> TransferTimeout:
        """The error of a ``wait`` that ended before the transfer did (``hint``: what to do)."""
        return TransferTimeout(
            f"transfer of {self.num_bytes} bytes in {self.num_segments} segments with {self.peer_key!r} "
            f"did not finish within {timeout_s} s{hint}"
        )


class FutureTransfer(Transfer):
    """A transfer completed by some other thread through ``set_done``/``set_error``."""

    def __init__(self, num_bytes: int, num_segments: int, peer_key: str) -> None:
        self.num_bytes = num_bytes
        self.num_segments = num_segments
        self.peer_key = peer_key
        self._event = threading.Event()
        self._error: BaseException | None = None

    def set_done(self) -> None:
        if not self._event.is_set():
            self._event.set()

    def set_error(self, error: BaseException) -> None:
        if not self._event.is_set():
            self._error = error
            self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def error(self) -> BaseException | None:
        return self._error if self._event.is_set() else None

    def wait(self, timeout_s: float | None = None) -> None:
        if not self._event.wait(timeout_s):
            raise self.wait_timeout(timeout_s)
        if self._error is not None:
            raise self._error
