"""D's quarantine and P's settling of pushes, without Ray.

- A push that ends early starts no more writes (``settle``), waits for the writes started, and says
  whether any may still land; none starts past the reservation's deadline.
- The quarantine frees a WRITE reservation's blocks on P's word or at the deadline, never before;
  a READ hold frees them once the read has ended, and only then releases P's lease.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from moriio_ray.errors import TransferTimeout
from moriio_ray.transfer.handle import FutureTransfer
from moriio_ray.worker.push import LayerPusher, push_targets
from moriio_ray.worker.quarantine import Quarantine
from tests.faults import LateWriteAgent
from tests.unit.test_tp_transfer import WHOLE, Rank

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair() -> Iterator[tuple[Rank, Rank]]:
    p, d = Rank("p", 0, 1), Rank("d", 0, 1)
    p.agent.connect(d.agent.engine_desc())
    yield p, d
    p.agent.close()
    d.agent.close()


def test_a_settled_push_starts_no_more_writes_and_waits_for_those_started(pair: tuple[Rank, Rank]) -> None:
    p, d = pair
    late = LateWriteAgent(p.agent)  # writes are held until released
    pusher = LayerPusher(late, p.mem, p.layout, push_targets(p.layout, [d.desc]), [7, 8])
    pusher.on_layer(0, WHOLE, [3, 4])
    assert len(late.held) == 1
    assert pusher.settle(0.2) is False  # the held write may still land
    pusher.on_layer(1, WHOLE, [3, 4])  # the forward pass goes on: no write starts any more
    assert len(late.held) == 1 and len(pusher.transfers) == 1
    assert late.release() == 1
    assert pusher.settle(0.2) is True


def test_no_push_starts_past_the_reservations_deadline(pair: tuple[Rank, Rank]) -> None:
    p, d = pair
    targets = push_targets(p.layout, [d.desc])
    pusher = LayerPusher(p.agent, p.mem, p.layout, targets, [7, 8], time.time() - 0.01)
    pusher.on_layer(0, WHOLE, [3, 4])
    assert pusher.transfers == []
    with pytest.raises(TransferTimeout, match="deadline passed before layer 0"):
        pusher.wait_all(1.0)


def _quarantine() -> tuple[Quarantine, list[str], set[asyncio.Task[None]]]:
    freed: list[str] = []
    tasks: set[asyncio.Task[None]] = set()
    q = Quarantine(freed.append, lambda coro: tasks.add(asyncio.ensure_future(coro)))
    return q, freed, tasks


def test_a_held_reservation_is_freed_on_ps_word_and_not_before() -> None:
    async def run() -> None:
        q, freed, tasks = _quarantine()
        q.hold_push("r1", "e1", time.time() + 30)
        await asyncio.sleep(0.05)
        assert "e1" in q and freed == []
        assert q.pushes_ended("other") is False
        assert q.pushes_ended("r1") is True
        await asyncio.gather(*tasks)
        assert freed == ["e1"] and "e1" not in q and len(q) == 0

    asyncio.run(run())


def test_a_held_reservation_is_freed_at_its_deadline_without_ps_word() -> None:
    async def run() -> None:
        q, freed, tasks = _quarantine()
        until = time.time() + 0.3
        q.hold_push("r1", "e1", until)
        await asyncio.gather(*tasks)
        assert freed == ["e1"] and time.time() >= until

    asyncio.run(run())


def test_a_held_read_frees_its_blocks_then_releases_the_lease() -> None:
    async def run() -> None:
        q, freed, tasks = _quarantine()
        xfer = FutureTransfer(64, 1, "p")
        order: list[str] = []
        q.hold_read("e1", xfer, 30.0, then=lambda: order.append(f"release after {freed}"))
        await asyncio.sleep(0.05)
        assert "e1" in q and freed == [] and order == []
        xfer.set_done()
        await asyncio.gather(*tasks)
        assert order == ["release after ['e1']"]

    asyncio.run(run())
