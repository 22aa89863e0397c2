"""The P -> D hand-over mailbox: either order, each request once, duplicates refused, deadlines."""

from __future__ import annotations

import asyncio

import pytest

from moriio_ray.errors import DeadlineExceeded, RequestCancelled
from moriio_ray.worker.mailbox import Mailbox


@pytest.mark.timeout(10)
def test_delivery_before_and_after_take() -> None:
    async def run() -> None:
        box: Mailbox[str] = Mailbox()
        assert box.deliver("early", "h1")
        item, _ = await box.take("early", 1.0)
        assert item == "h1"

        waiter = asyncio.ensure_future(box.take("late", 5.0))
        await asyncio.sleep(0)  # let the taker register before the delivery
        assert box.deliver("late", "h2")
        item, arrived = await waiter
        assert item == "h2" and arrived > 0

        # each id is served once: a second delivery (a retried prefill) is refused
        assert not box.deliver("late", "again")
        with pytest.raises(RequestCancelled):
            await box.take("late", 1.0)

    asyncio.run(run())


@pytest.mark.timeout(10)
def test_deadline_and_abandon() -> None:
    async def run() -> None:
        box: Mailbox[str] = Mailbox()
        with pytest.raises(DeadlineExceeded, match="no prefill result for r1"):
            await box.take("r1", 0.05)
        assert box.deliver("r2", "h") and box.abandon("r2") == "h"  # arrived, nobody will read it
        assert box.abandon("r3") is None
        assert not box.deliver("r3", "late")  # arrives after its decode gave up: refused

    asyncio.run(run())


@pytest.mark.timeout(10)
def test_a_take_cancelled_just_after_its_delivery_leaves_the_item_to_abandon() -> None:
    # The hand-over resolves the waiting take; the decode call is cancelled before it resumes.
    # The item (a lease on P) must not be lost: whoever abandons the request gets it, to release it.
    async def run() -> None:
        box: Mailbox[str] = Mailbox()
        waiter = asyncio.ensure_future(box.take("r", 5.0))
        await asyncio.sleep(0)
        assert box.deliver("r", "lease")
        waiter.cancel()  # before the taker has run again
        try:
            owner = await waiter  # the take may still return it (asyncio.wait_for on 3.11)
        except asyncio.CancelledError:
            owner = box.abandon("r")  # else whoever abandons the request gets it
        else:
            assert box.abandon("r") is None  # one owner only
        assert owner == "lease" or owner == ("lease", pytest.approx(owner[1]))

    asyncio.run(run())
