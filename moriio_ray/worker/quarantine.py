"""Blocks that a late transfer may still write, kept out of use until it has ended (D's side).

- READ: a read that was cancelled, or ran past its deadline, may still land in the request's
  blocks. They are held until the read has ended (bounded by the transfer's deadline plus grace),
  then freed, and only then is P told to release its lease: the read may still be reading P's
  blocks, and no block is freed while a peer may still read it.
- WRITE: a request that ends before P's push result reached D (cancelled, failed, timed out) may
  still receive pushes, since P's writes are one-sided. Its reserved blocks are held until P says
  that its pushes have ended (``pushes_ended``), or until the reservation's deadline plus grace (P
  issues no push past the deadline, and grace covers the pushes in flight at that moment).

A held request's engine id is in ``self``; a late abort of it must not free its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from moriio_ray.transfer.handle import Transfer

log = logging.getLogger(__name__)

Free = Callable[[str], None]  # frees an engine id's blocks (posted to the engine thread)
Spawn = Callable[[Coroutine[Any, Any, Any]], Any]


class Quarantine:
    """The engine ids whose blocks a transfer may still write (asyncio thread)."""

    def __init__(self, free: Free, spawn: Spawn) -> None:
        self._free = free
        self._spawn = spawn
        self._held: set[str] = set()  # engine ids
        self._pushes: dict[str, asyncio.Event] = {}  # WRITE: request id -> set once P's pushes end

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def hold_read(
        self, engine_id: str, xfer: Transfer, max_wait_s: float, then: Callable[[], None] | None = None
    ) -> None:
        """READ: free ``engine_id``'s blocks once ``xfer`` has ended (at most ``max_wait_s``), then
        call ``then`` (the release of P's lease)."""

        async def until_ended() -> None:
            try:
                await asyncio.to_thread(xfer.wait, max_wait_s)
            except Exception:
                pass  # failed or still running after max_wait_s: either way it is over for us

        self._hold(engine_id, until_ended(), then)

    def hold_push(self, request_id: str, engine_id: str, until_unix: float) -> None:
        """WRITE: free ``engine_id``'s blocks once P reports that its pushes of ``request_id`` have
        ended, or at ``until_unix`` (the reservation's deadline plus grace)."""
        ended = self._pushes.setdefault(request_id, asyncio.Event())

        async def until_ended() -> None:
            try:
                await asyncio.wait_for(ended.wait(), max(0.0, until_unix - time.time()))
            except asyncio.TimeoutError:
                log.warning("no end of the pushes of %s came; freeing its blocks at its deadline", request_id)
            finally:
                self._pushes.pop(request_id, None)

        self._hold(engine_id, until_ended(), None)

    def pushes_ended(self, request_id: str) -> bool:
        """P's pushes of ``request_id`` have ended: a hold on its blocks ends now. False if none held."""
        ended = self._pushes.get(request_id)
        if ended is None:
            return False
        ended.set()
        return True

    def _hold(
        self, engine_id: str, until: Coroutine[Any, Any, None], then: Callable[[], None] | None
    ) -> None:
        async def free_later() -> None:
            try:
                await until
            finally:
                self._held.discard(engine_id)
                self._free(engine_id)
                if then is not None:
                    then()

        self._held.add(engine_id)
        self._spawn(free_later())
