"""A caller's subscription to one request's outputs wakes its reader once per chunk it asked for:
k tokens pending, or the request's end or error, whichever comes first; never loses an output."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from moriio_ray.caller.streams import Subscription
from moriio_ray.errors import DeadlineExceeded
from moriio_ray.protocol.messages import RequestOutput


def _sub() -> Subscription:
    pump: Any = SimpleNamespace(streams=SimpleNamespace(watch=lambda: None), member=SimpleNamespace(key="w"))
    pump.subs = {}
    return Subscription(pump, "r")


def _out(*tokens: int, finish: str | None = None) -> RequestOutput:
    return RequestOutput("r", list(tokens), finish_reason=finish)


async def _woken(task: asyncio.Task[Any]) -> bool:
    for _ in range(3):  # let the loop run the wake-up, if there was one
        await asyncio.sleep(0)
    return task.done()


@pytest.mark.timeout(10)
def test_a_chunk_wait_wakes_at_k_tokens_with_every_output() -> None:
    async def go() -> None:
        sub = _sub()
        reader = asyncio.ensure_future(sub.next(5.0, chunk_tokens=4))
        sub.put(_out(1))
        sub.put(_out(2, 3))
        assert not await _woken(reader)  # 3 tokens of 4: still waiting
        sub.put(_out(4, 5))
        assert await _woken(reader)
        items = reader.result()
        assert [t for i in items for t in i.token_ids] == [1, 2, 3, 4, 5]

    asyncio.run(go())


@pytest.mark.timeout(10)
def test_the_end_or_an_error_wakes_a_chunk_wait_early() -> None:
    async def go() -> None:
        sub = _sub()
        reader = asyncio.ensure_future(sub.next(5.0, chunk_tokens=64))
        sub.put(_out(1))
        assert not await _woken(reader)
        sub.put(_out(2, finish="length"))
        assert await _woken(reader)
        assert [i.finish_reason for i in reader.result()] == [None, "length"]

        sub = _sub()
        reader = asyncio.ensure_future(sub.next(5.0, chunk_tokens=64))
        sub.put(RequestOutput("r", [], error=("PeerLost", "gone")))
        assert await _woken(reader)
        assert reader.result()[0].error == ("PeerLost", "gone")

        sub = _sub()  # the end already pending: no wait at all
        sub.put(_out(7, finish="stop"))
        assert [i.token_ids for i in await sub.next(5.0, chunk_tokens=64)] == [[7]]

    asyncio.run(go())


@pytest.mark.timeout(10)
def test_one_token_chunks_wake_per_output_and_a_deadline_returns_what_came() -> None:
    async def go() -> None:
        sub = _sub()
        reader = asyncio.ensure_future(sub.next(5.0))
        sub.put(_out(1))
        assert await _woken(reader)

        sub = _sub()
        reader = asyncio.ensure_future(sub.next(5.0, chunk_tokens=8))
        await asyncio.sleep(0)  # it waits now, its deadline set
        sub.put(_out(1, 2))
        assert not await _woken(reader)
        sub.expire_if_late(sub.deadline_s + 1)  # the watchdog, past the deadline
        assert await _woken(reader)
        assert [i.token_ids for i in reader.result()] == [[1, 2]]

        sub = _sub()
        reader = asyncio.ensure_future(sub.next(5.0, chunk_tokens=8))
        await asyncio.sleep(0)
        sub.expire_if_late(sub.deadline_s + 1)
        with pytest.raises(DeadlineExceeded):
            await reader

    asyncio.run(go())
