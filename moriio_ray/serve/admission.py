"""Backpressure: a bounded count of generation requests in flight on one ingress replica.

A request beyond the bound is refused at once (429), never queued: an unbounded queue only turns
overload into timeouts. ``Slot`` is the admission of one request; releasing it twice is harmless, so
every exit path (normal end, error, client disconnect, a response never sent) may release it.
"""

from __future__ import annotations

from moriio_ray.serve.errors import overloaded


class Admission:
    """At most ``limit`` slots held at once. Single event loop; not thread-safe."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit: {limit} must be >= 1")
        self.limit = limit
        self.in_flight = 0
        self.admitted = 0
        self.rejected = 0

    def acquire(self, count: int = 1) -> Slot:
        """A slot for ``count`` requests (the choices of one HTTP request), or a 429 APIError when
        they do not fit under ``limit``."""
        if self.in_flight + count > self.limit:
            self.rejected += 1
            raise overloaded(self.limit)
        self.in_flight += count
        self.admitted += 1
        return Slot(self, count)

    def stats(self) -> dict[str, int]:
        return {
            "limit": self.limit,
            "in_flight": self.in_flight,
            "admitted": self.admitted,
            "rejected": self.rejected,
        }


class Slot:
    """One admitted request. ``release`` is idempotent; a slot dropped unreleased releases itself."""

    def __init__(self, owner: Admission, count: int = 1) -> None:
        self._owner: Admission | None = owner
        self.count = count

    @property
    def held(self) -> bool:
        return self._owner is not None

    def release(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.in_flight -= self.count

    def __del__(self) -> None:
        # A streaming response that Serve never started (the client left in between) is dropped
        # without running its cleanup; the slot must not leak with it.
        self.release()
