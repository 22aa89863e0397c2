"""P's hand-overs to D (``worker/handovers.py``): one ``deliver`` call per D per loop turn, every
hand-over answered with its own outcome, and a failed call failing each of its hand-overs."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from moriio_ray.errors import DeadlineExceeded
from moriio_ray.worker.handovers import Handovers, Item
from moriio_ray.worker.peers import Peer


class _FakeD:
    """A D actor's ``deliver``: records each call's items and answers with ``answer(items)``."""

    def __init__(self, answer: Any = None, hang: bool = False) -> None:
        self.calls: list[list[Item]] = []
        self.answer = answer or (lambda items: [None] * len(items))
        self.hang = hang
        self.deliver = SimpleNamespace(remote=self._remote)

    def _remote(self, items: list[Item]) -> asyncio.Future[list[str | None]]:
        self.calls.append(list(items))
        future: asyncio.Future[list[str | None]] = asyncio.get_running_loop().create_future()
        if not self.hang:
            answer = self.answer(items)
            if isinstance(answer, BaseException):
                future.set_exception(answer)
            else:
                future.set_result(answer)
        return future


def _peer(key: str, actor: _FakeD, epoch: int = 1) -> Peer:
    return cast(Peer, SimpleNamespace(key=key, epoch=epoch, actor=actor))


def _item(i: int) -> Item:
    return (f"req{i}".encode(), f"handoff{i}".encode(), "caller")


def _handovers() -> tuple[Handovers, set[asyncio.Task[Any]]]:
    tasks: set[asyncio.Task[Any]] = set()

    def spawn(coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        tasks.add(task)

    return Handovers(spawn), tasks


@pytest.mark.timeout(10)
def test_one_call_per_d_per_loop_turn_each_item_its_own_outcome() -> None:
    async def run() -> None:
        handovers, _ = _handovers()
        d1 = _FakeD(answer=lambda items: [None if b"req1" != r else "refused" for r, _h, _c in items])
        d2 = _FakeD()
        p1, p2 = _peer("decode-0", d1), _peer("decode-1", d2)
        first = [handovers.hand_over(p1, _item(i), 5.0) for i in range(3)]
        other = handovers.hand_over(p2, _item(9), 5.0)
        assert d1.calls == [] and d2.calls == []  # nothing leaves before the turn ends
        outcomes = await asyncio.gather(*first, other)
        assert outcomes == [None, "refused", None, None]
        assert d1.calls == [[_item(0), _item(1), _item(2)]]  # in the order they were queued
        assert d2.calls == [[_item(9)]]
        later = await handovers.hand_over(p1, _item(3), 5.0)  # a later turn: a call of its own
        assert later is None and len(d1.calls) == 2 and d1.calls[1] == [_item(3)]
        assert (handovers.calls, handovers.items) == (3, 5)

    asyncio.run(run())


@pytest.mark.timeout(10)
def test_a_failed_or_late_call_fails_every_hand_over_in_it() -> None:
    async def run() -> None:
        handovers, _ = _handovers()
        dead = _peer("decode-0", _FakeD(answer=lambda items: RuntimeError("the actor died")))
        late = _peer("decode-1", _FakeD(hang=True))
        short = _peer("decode-2", _FakeD(answer=lambda items: [None]))  # answers 1 of 2
        died = [handovers.hand_over(dead, _item(i), 5.0) for i in range(2)]
        waited = [handovers.hand_over(late, _item(i), 0.05) for i in range(2)]
        wrong = [handovers.hand_over(short, _item(i), 5.0) for i in range(2)]
        for future in died:
            with pytest.raises(RuntimeError, match="died"):
                await future
        for future in waited:
            with pytest.raises(DeadlineExceeded):
                await future
        for future in wrong:
            with pytest.raises(RuntimeError, match="answered 1 of 2"):
                await future

    asyncio.run(run())


@pytest.mark.timeout(10)
def test_a_replaced_d_gets_its_own_call() -> None:
    async def run() -> None:
        handovers, _ = _handovers()
        old, new = _FakeD(), _FakeD()
        a = handovers.hand_over(_peer("decode-0", old, epoch=1), _item(0), 5.0)
        b = handovers.hand_over(_peer("decode-0", new, epoch=2), _item(1), 5.0)
        assert await asyncio.gather(a, b) == [None, None]
        assert old.calls == [[_item(0)]] and new.calls == [[_item(1)]]

    asyncio.run(run())
