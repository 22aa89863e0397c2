"""Clean-up calls leave the sending task's Ray lineage: Ray finds a call's parent task through the
``async_task_id`` context variable in an async actor, and cancels a cancelled task's calls with it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray._raylet import async_task_id

from moriio_ray.protocol.detached import send, spawn


class _Method:
    """Records the parent task id that Ray would see when ``remote`` is called."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []

    def remote(self, *args: Any) -> str:
        self.calls.append((async_task_id.get(), args))
        return "ref"


@pytest.mark.timeout(10)
def test_send_and_spawn_leave_the_current_task_lineage() -> None:
    method = _Method()

    async def request_task() -> None:
        async_task_id.set("the-request-task")  # what Ray sets while it runs a request's call
        method.remote("plain")
        assert send(method, "abort", 1) == "ref"

        async def later() -> None:
            method.remote("spawned")

        await spawn(later())
        assert async_task_id.get() == "the-request-task"  # the sender's own context is untouched

    asyncio.run(request_task())
    assert method.calls == [("the-request-task", ("plain",)), (None, ("abort", 1)), (None, ("spawned",))]
