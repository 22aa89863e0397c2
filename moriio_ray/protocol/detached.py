"""Ray calls that must arrive, whatever happens to the task that sends them.

Ray cancels a cancelled task's children too: every call that the task (or a task it called, and
so on) submitted and that has not run yet. Serve cancels a request's task that way when its client
leaves. The calls that clean a request up (an abort, D's release of P's lease, P's hand-over to D,
whose receiver releases what it cannot use) are submitted by that very task tree, so they must be
sent outside it, or a client that leaves at the wrong moment leaves P's lease held until it expires.

In an async actor Ray finds a call's parent task through a context variable; a call submitted in an
empty context has none to be cancelled with (Ray Serve's own long-poll client does the same).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any


def send(method: Any, *args: Any, **kwargs: Any) -> Any:
    """``method.remote(*args, **kwargs)`` outside the current task's lineage; its ObjectRef."""
    return contextvars.Context().run(method.remote, *args, **kwargs)


def spawn(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    """Run ``coro`` as a task outside the current task's lineage (Ray calls in it included)."""
    return contextvars.Context().run(asyncio.ensure_future, coro)
