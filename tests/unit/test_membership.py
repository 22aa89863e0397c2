"""The membership as deltas (coordinator/changes.py, protocol/membership.py), the router's indexed
picks, and a worker's pool watch, without Ray actors."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import pytest
import ray

from moriio_ray.caller.router import Router
from moriio_ray.coordinator.changes import ChangeLog
from moriio_ray.errors import CapacityError
from moriio_ray.protocol.membership import merge, pack, unpack
from moriio_ray.protocol.messages import Member, Membership
from moriio_ray.worker import pool_watch
from moriio_ray.worker.pool_watch import PoolWatch

pytestmark = pytest.mark.timeout(60)


def member(key: str, epoch: int = 1, role: str = "decode", node: str = "n0") -> Member:
    return Member(key, role, epoch, node, actor_name=f"worker:{key}:{epoch}", info_data=b"")


def keys(m: Membership) -> dict[str, int]:
    return {x.key: x.epoch for x in m.members}


# -- merge and the change log ----------------------------------------------------------------------


def test_a_change_applies_to_its_base_version_only() -> None:
    base = Membership(version=3, members=[member("a"), member("b"), member("c")])
    change = Membership(version=5, members=[member("b", 2), member("d")], base_version=3, removed=[("c", 1)])
    merged = merge(base, change)
    assert merged is not None and merged.version == 5 and not merged.is_delta
    assert keys(merged) == {"a": 1, "b": 2, "d": 1}
    assert merge(Membership(version=4, members=base.members), change) is None  # a gap
    whole = Membership(version=9, members=[member("z")])
    assert merge(base, whole) is whole


def test_the_log_answers_a_change_or_a_snapshot() -> None:
    log = ChangeLog(limit=4)
    members: dict[str, Member] = {}
    version = 0
    for i in range(3):
        version += 1
        members[f"e{i}"] = member(f"e{i}")
        log.record(version, [members[f"e{i}"]], [])
    snapshot = log.answer(-1, version, lambda: list(members.values()))
    assert not snapshot.is_delta and keys(snapshot) == {"e0": 1, "e1": 1, "e2": 1}
    change = log.answer(1, version, lambda: list(members.values()))
    assert change.is_delta and change.base_version == 1 and keys(change) == {"e1": 1, "e2": 1}
    assert log.answer(version, version, list).members == []  # nothing new
    # removed then back at a new epoch: an upsert, not a removal
    log.record(4, [], [("e1", 1)])
    log.record(5, [member("e1", 2)], [])
    change = log.answer(3, 5, list)
    assert keys(change) == {"e1": 2} and change.removed == []
    log.record(6, [], [("e0", 1)])
    log.record(7, [], [("e2", 1)])  # the log holds 4: versions 4..7
    assert log.answer(2, 7, lambda: [member("e1", 2)]).is_delta is False  # too old: a snapshot
    assert log.answer(3, 7, list).removed == [("e0", 1), ("e2", 1)]


def test_a_view_following_the_log_always_equals_the_pool() -> None:
    """Random joins, deaths and replacements; watchers at random versions catch up by one
    answer each (packed as the coordinator sends it) and then hold exactly its membership."""
    rng = random.Random(7)
    log = ChangeLog(limit=16)
    pool: dict[str, Member] = {}
    views = [Membership(version=-1) for _ in range(6)]
    version = 0
    for _ in range(400):
        version += 1
        key = f"e{rng.randrange(12)}"
        if key in pool and rng.random() < 0.5:
            gone = pool.pop(key)
            log.record(version, [], [(gone.key, gone.epoch)])
        else:
            pool[key] = member(key, pool[key].epoch + 1 if key in pool else 1)
            log.record(version, [pool[key]], [])
        for i, view in enumerate(views):
            if rng.random() < 0.3:  # this watcher polls now
                answer = unpack(pack(log.answer(view.version, version, lambda: list(pool.values()))))
                merged = merge(view, answer)
                assert merged is not None
                views[i] = merged
                assert keys(merged) == {k: m.epoch for k, m in pool.items()}


def test_a_packed_member_keeps_every_field_and_decodes_its_descriptors_lazily() -> None:
    m = Member("k", "prefill", 3, "node", "worker:p:k:3", b"\x01\x02", True)
    change = Membership(version=7, members=[m], base_version=5, removed=[("j", 2)])
    back = unpack(pack(change))
    (b,) = back.members
    assert (back.version, back.base_version, back.removed) == (7, 5, [("j", 2)])
    assert [getattr(b, f) for f in Member.FIELDS] == [getattr(m, f) for f in Member.FIELDS]
    assert b._info is None and b._actor is None  # nothing decoded or looked up yet


# -- the router ------------------------------------------------------------------------------------


def pool_of(n: int, nodes: int = 4) -> Membership:
    return Membership(
        version=1,
        members=[
            member(f"e{i}", role="prefill" if i % 2 else "decode", node=f"n{i % nodes}") for i in range(n)
        ],
    )


def test_the_router_picks_within_role_node_and_exclusions() -> None:
    router = Router(seed=1)
    assert router.update(pool_of(40))
    for _ in range(200):
        p = router.pick("prefill")
        assert p.role == "prefill"
        d = router.pick("decode", node_id="n2", exclude={"e2"})
        assert d.role == "decode" and d.node_id == "n2" and d.key != "e2"
    decodes_n2 = [m.key for m in router.membership.members if m.role == "decode" and m.node_id == "n2"]
    only = router.pick("decode", node_id="n2", exclude=decodes_n2[1:])
    assert only.key == decodes_n2[0]
    with pytest.raises(CapacityError, match="no live decode worker on node n2"):
        router.pick("decode", node_id="n2", exclude=decodes_n2)
    with pytest.raises(CapacityError):
        router.pick("colocated")


def test_the_router_spreads_load_and_prefers_the_less_busy() -> None:
    router = Router(seed=2)
    router.update(pool_of(200))
    counts = Counter(router.pick("decode").key for _ in range(20_000))
    assert len(counts) == 100  # every decode worker is drawn
    busy = Router(seed=3)
    busy.update(Membership(version=1, members=[member("a"), member("b")]))
    busy.acquire(busy.membership.members[0], 100)
    assert all(busy.pick("decode").key == "b" for _ in range(50))


def test_the_router_applies_changes_and_refuses_a_gap() -> None:
    router = Router(seed=4)
    router.update(pool_of(4))
    router.acquire(router.membership.find("e0"), 1)  # type: ignore[arg-type]
    change = Membership(
        version=2, members=[member("e0", 2, role="decode")], base_version=1, removed=[("e1", 1)]
    )
    assert router.update(change)
    assert keys(router.membership) == {"e0": 2, "e2": 1, "e3": 1}
    assert "e0" not in router.served  # a replacement starts with a clean record
    assert all(router.pick("prefill").key == "e3" for _ in range(20))  # e1 is gone
    gap = Membership(version=9, members=[member("x")], base_version=7)
    assert router.update(gap) is False and router.membership.version == 2
    assert router.update(Membership(version=1, members=[]))  # older: ignored
    assert router.membership.version == 2


# -- a worker's pool watch -------------------------------------------------------------------------


class FakePeers:
    def __init__(self) -> None:
        self.connected: list[str] = []
        self.lost_keys: list[tuple[str, int]] = []
        self.known: dict[str, Member] = {}

    async def add_members(self, members: list[Member], *, roles: set[str]) -> None:
        self.connected += [m.key for m in members if m.role in roles]

    def lost(self, key: str, epoch: int) -> None:
        self.lost_keys.append((key, epoch))

    def learn(self, members: list[Member], *, whole: bool) -> None:
        if whole:
            self.known.clear()
        self.known.update({m.key: m for m in members})


class FakeCoordinator:
    """Answers ``watch.remote`` from a change log, or raises the queued errors."""

    def __init__(self) -> None:
        self.log = ChangeLog()
        self.pool: dict[str, Member] = {}
        self.version = 0
        self.errors: list[BaseException] = []
        self.watch = self

    def change(self, up: list[Member] = (), down: list[str] = ()) -> None:  # type: ignore[assignment]
        self.version += 1
        gone = [(k, self.pool.pop(k).epoch) for k in down]
        self.pool.update({m.key: m for m in up})
        self.log.record(self.version, list(up), gone)

    def remote(self, since: int, timeout_s: float) -> Any:
        async def answer() -> bytes:
            if self.errors:
                raise self.errors.pop(0)
            return pack(self.log.answer(since, self.version, lambda: list(self.pool.values())))

        return answer()


def test_a_worker_follows_the_pool_and_connects_eagerly_up_to_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_watch, "EAGER_PEERS", 3)
    coord, peers = FakeCoordinator(), FakePeers()
    watch = PoolWatch(coord, peers, "prefill", 5.0)  # type: ignore[arg-type]

    async def run() -> None:
        coord.change(up=[member("d0"), member("d1"), member("p0", role="prefill")])
        await watch.watch.refresh()
        await asyncio.sleep(0)
        assert sorted(peers.connected) == ["d0", "d1"] and set(peers.known) == {"d0", "d1", "p0"}
        coord.change(down=["d1"])
        coord.change(up=[member("d2"), member("d3")])  # 3 decode workers: still eager
        await watch.watch.refresh()
        await asyncio.sleep(0)
        assert peers.lost_keys == [("d1", 1)] and sorted(peers.connected) == ["d0", "d1", "d2", "d3"]
        assert {k: m.epoch for k, m in watch.members.items()} == {"d0": 1, "p0": 1, "d2": 1, "d3": 1}
        coord.change(up=[member("d4")])  # 4 > 3: on first use only
        await watch.watch.refresh()
        await asyncio.sleep(0)
        assert "d4" not in peers.connected and "d4" in peers.known

    asyncio.run(run())


def test_a_worker_ends_its_pool_only_when_the_coordinator_is_dead_three_times_in_a_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_watch, "RETRY_S", 0.0)
    monkeypatch.setattr(pool_watch, "POLL_S", 0.0)
    coord = FakeCoordinator()
    died = ray.exceptions.ActorDiedError
    # restarting (unavailable) resets the count; then three deaths in a row
    coord.errors = [died(), died(), RuntimeError("restarting"), died(), died(), died()]
    watch = PoolWatch(coord, FakePeers(), "decode", 5.0)  # type: ignore[arg-type]
    assert asyncio.run(watch.run(lambda: False)) is True
    assert coord.errors == []
    closed = PoolWatch(FakeCoordinator(), FakePeers(), "decode", 5.0)  # type: ignore[arg-type]
    assert asyncio.run(closed.run(lambda: True)) is False
