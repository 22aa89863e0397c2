"""A deadline on a remote await that tells its own timeout from a TimeoutError the callee raised."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from moriio_ray.errors import DeadlineExceeded

T = TypeVar("T")


async def deadline(aw: Awaitable[T], timeout_s: float, what: str) -> T:
    """Await ``aw`` for at most ``timeout_s``; DeadlineExceeded names ``what`` when time runs out.

    (``asyncio.wait_for`` would also turn a TransferTimeout raised by the callee into a timeout of
    the await itself, since both are TimeoutErrors.)
    """
    fut = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({fut}, timeout=timeout_s)
    except asyncio.CancelledError:
        fut.cancel()
        raise
    if not done:
        fut.cancel()
        raise DeadlineExceeded(f"{what} did not answer within {timeout_s} s")
    return fut.result()
