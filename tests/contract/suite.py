"""The transfer-agent contract: what every backend must do, as tests over a ``harness`` fixture.

A backend's test module defines a ``harness`` fixture (see ``harness.py``) and a subclass of
``ContractSuite``. Memory is compared on the host, so the suite runs unchanged for GPU backends.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from moriio_ray.errors import PeerLost, SegmentOutOfBounds, StaleDescriptor, TokenRejected, TransferTimeout
from moriio_ray.transfer import MemoryDesc, Transfer, TransferAgent, TransferPlan
from moriio_ray.transfer.base import Local
from tests.contract.harness import Harness, Hold, PeerProcess, pattern

KiB = 1 << 10
MiB = 1 << 20
WAIT_S = 10.0  # a bound on every wait for a transfer that must finish
BIG = 32 * MiB  # the mid-transfer tests move this much, so that there is something in flight
TIMEOUT_S = 5.0  # transfer.timeout_s of agents in the failure tests


def host(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a host numpy array (a copy for device memory)."""
    return tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy()


def pair(
    harness: Harness, num_bytes: int, **config: Any
) -> tuple[TransferAgent, TransferAgent, torch.Tensor, MemoryDesc, torch.Tensor, MemoryDesc]:
    """Agent ``decode-0`` (zeroed region) connected to agent ``prefill-0`` (region = pattern(1))."""
    a = harness.make_agent("decode-0", **config)
    b = harness.make_agent("prefill-0", **config)
    ta, ma = harness.region(a, num_bytes)
    tb, mb = harness.region(b, num_bytes, seed=1)
    a.connect(b.engine_desc())
    return a, b, ta, ma, tb, mb


def big_batch() -> TransferPlan:
    """BIG bytes in 64 KiB segments, remote order reversed so nothing coalesces."""
    n = BIG // (64 * KiB)
    lo = np.arange(n, dtype=np.int64) * 64 * KiB
    return TransferPlan(lo, lo[::-1].copy(), np.full(n, 64 * KiB, dtype=np.int64))


def require_hold(harness: Harness) -> None:
    if harness.hold_side is None:
        pytest.skip(f"backend {harness.backend!r} has no hook to park a transfer mid-way")


def require_peer_process(harness: Harness) -> None:
    if harness.no_peer_process is not None:
        pytest.skip(harness.no_peer_process)


def parked_read(
    harness: Harness,
    agent: TransferAgent,
    peer: TransferAgent | PeerProcess,
    local: MemoryDesc,
    remote: MemoryDesc,
) -> tuple[Transfer, Hold]:
    """A BIG read, parked by the backend's test hook once 1 MiB has moved."""
    hold = harness.hold(agent, peer, MiB)
    x = agent.read(local, remote, big_batch())
    assert hold.wait_held(WAIT_S), "the transfer never reached the hold"
    assert not x.done()
    return x, hold


def finish(call: object) -> Transfer:
    """Wait for a transfer (errors may surface at issue or at wait: both are within the contract)."""
    assert isinstance(call, Transfer)
    call.wait(WAIT_S)
    return call


class ContractSuite:
    """Every backend passes these. Capabilities that do not apply are skipped with a reason."""

    # -- round trips ----------------------------------------------------------------------------

    @pytest.mark.timeout(30)
    def test_round_trip_single(self, harness: Harness) -> None:
        a, _, ta, ma, tb, mb = pair(harness, MiB)
        x = finish(a.read(ma, mb, TransferPlan([0], [4096], [65536])))
        assert x.done() and x.error() is None and x.bytes_moved == 65536
        assert np.array_equal(host(ta)[:65536], pattern(1, MiB)[4096 : 4096 + 65536])
        ta[200_000:203_000] = 7
        finish(a.write(ma, mb, TransferPlan([200_000], [500_000], [3000])))
        assert (host(tb)[500_000:503_000] == 7).all()
        assert np.array_equal(host(tb)[:500_000], pattern(1, MiB)[:500_000])  # nothing else touched

    @pytest.mark.timeout(30)
    def test_round_trip_batched(self, harness: Harness) -> None:
        a, _, ta, ma, tb, mb = pair(harness, MiB)
        blocks = np.random.default_rng(3).permutation(64)[:48].astype(np.int64)  # 16 KiB blocks
        lo, ro = np.arange(48, dtype=np.int64) * 16 * KiB, blocks * 16 * KiB
        sz = np.full(48, 16 * KiB, dtype=np.int64)
        x = finish(a.read(ma, mb, TransferPlan(lo, ro, sz)))
        assert x.num_segments == 48 and x.bytes_moved == 48 * 16 * KiB
        expect = pattern(1, MiB).reshape(64, 16 * KiB)[blocks].reshape(-1)
        assert np.array_equal(host(ta)[: 48 * 16 * KiB], expect)
        ta.zero_()
        finish(a.write(ma, mb, TransferPlan(lo, ro, sz)))  # zeros land exactly on the 48 blocks
        rows = host(tb).reshape(64, 16 * KiB)
        assert (rows[blocks] == 0).all()
        untouched = np.setdiff1d(np.arange(64), blocks)
        assert np.array_equal(rows[untouched], pattern(1, MiB).reshape(64, 16 * KiB)[untouched])

    @pytest.mark.timeout(60)
    def test_round_trip_with_peer_process(self, harness: Harness) -> None:
        require_peer_process(harness)
        a = harness.make_agent("decode-0")
        ta, ma = harness.region(a, 4 * MiB)
        peer = harness.spawn_peer("prefill-0", 4 * MiB, seed=7)
        a.connect(peer.desc)
        n = 256
        lo = np.arange(n, dtype=np.int64) * 16 * KiB
        ro = np.random.default_rng(0).permutation(n).astype(np.int64) * 16 * KiB
        sz = np.full(n, 16 * KiB, dtype=np.int64)
        finish(a.read(ma, peer.mem, TransferPlan(lo, ro, sz)))
        expect = pattern(7, 4 * MiB).reshape(n, 16 * KiB)[ro // (16 * KiB)].reshape(-1)
        assert np.array_equal(host(ta), expect)
        ta.copy_(torch.from_numpy(pattern(8, 4 * MiB)))
        finish(a.write(ma, peer.mem, TransferPlan(lo, ro, sz)))
        remote = np.frombuffer(peer.call("bytes"), dtype=np.uint8).reshape(n, 16 * KiB)
        assert np.array_equal(remote[ro // (16 * KiB)].reshape(-1), pattern(8, 4 * MiB))

    @pytest.mark.timeout(60)
    @pytest.mark.parametrize("op", ["read", "write"])
    def test_random_scatter_gather_1000_segments(self, harness: Harness, op: str) -> None:
        a, _, ta, ma, tb, mb = pair(harness, 8 * MiB)
        rng = np.random.default_rng(11)
        ta.copy_(torch.from_numpy(pattern(2, 8 * MiB)))
        sz = rng.integers(1, 8 * KiB + 1, 1000).astype(np.int64)  # about 4 MiB in all
        lo, ro = random_offsets_for(rng, sz, 8 * MiB), random_offsets_for(rng, sz, 8 * MiB)
        local_ref, remote_ref = host(ta).copy(), host(tb).copy()
        dst, src = (local_ref, remote_ref) if op == "read" else (remote_ref, local_ref)
        d_off, s_off = (lo, ro) if op == "read" else (ro, lo)
        for d, s, n in zip(d_off.tolist(), s_off.tolist(), sz.tolist(), strict=True):
            dst[d : d + n] = src[s : s + n]
        finish(getattr(a, op)(ma, mb, TransferPlan(lo, ro, sz)))
        assert np.array_equal(host(ta), local_ref)
        assert np.array_equal(host(tb), remote_ref)

    # -- refusals -------------------------------------------------------------------------------

    @pytest.mark.timeout(30)
    def test_out_of_bounds_refused_on_the_local_side(self, harness: Harness) -> None:
        a, _, _, ma, _, mb = pair(harness, MiB)
        with pytest.raises(SegmentOutOfBounds, match=r"segment 1: local offset 1048570 \+ size 100"):
            a.read(ma, mb, TransferPlan([0, MiB - 6], [0, 4096], [10, 100]))
        with pytest.raises(SegmentOutOfBounds, match="segment 0: local offset -1"):
            a.write(ma, mb, TransferPlan([-1], [0], [10]))

    @pytest.mark.timeout(30)
    def test_out_of_bounds_refused_on_the_remote_side(self, harness: Harness) -> None:
        a, _, _, ma, _, mb = pair(harness, MiB)
        with pytest.raises(SegmentOutOfBounds, match=r"segment 2: remote offset 1048000 \+ size 4096"):
            a.read(ma, mb, TransferPlan([0, 10, 20], [0, 10, MiB - 576], [10, 10, 4096]))
        with pytest.raises(SegmentOutOfBounds, match="segment 0: remote offset -4096"):
            a.write(ma, mb, TransferPlan([0], [-4096], [10]))

    @pytest.mark.timeout(30)
    def test_out_of_bounds_refused_by_the_peer_itself(self, harness: Harness) -> None:
        """A descriptor that lies about its size passes this side's check; the peer side refuses."""
        a = harness.make_agent("decode-0")
        b = harness.make_agent("prefill-0")
        ta, ma = harness.region(a, 4 * MiB)
        _, mb = harness.region(b, MiB, seed=1)
        a.connect(b.engine_desc())
        forged = msgspec.structs.replace(mb, num_bytes=4 * MiB)
        with pytest.raises(SegmentOutOfBounds, match=r"segment 1: remote offset 2097152 \+ size 4096"):
            finish(a.read(ma, forged, TransferPlan([0, 4096], [0, 2 * MiB], [4096, 4096])))
        finish(a.read(ma, mb, TransferPlan([0], [0], [MiB])))  # the refusal left the connection usable
        assert np.array_equal(host(ta)[:MiB], pattern(1, MiB))

    @pytest.mark.timeout(30)
    def test_bad_token_refused(self, harness: Harness) -> None:
        if not harness.token_applies:
            pytest.skip(f"backend {harness.backend!r} takes no cluster token (it has no server to check one)")
        _, b, _, _, _, _ = pair(harness, MiB)
        intruder = harness.make_agent("intruder", token=b"not-the-cluster-token")
        with pytest.raises(TokenRejected, match="refused the cluster token"):
            intruder.connect(b.engine_desc())
        assert "prefill-0" not in intruder.peers()

    @pytest.mark.timeout(30)
    def test_descriptor_from_older_epoch_refused(self, harness: Harness) -> None:
        a = harness.make_agent("decode-0")
        old = harness.make_agent("prefill-0", epoch=1)
        new = harness.make_agent("prefill-0", epoch=2)
        ta, ma = harness.region(a, MiB)
        _, m_old = harness.region(old, MiB, seed=1)
        _, m_new = harness.region(new, MiB, seed=2)
        a.connect(new.engine_desc())
        with pytest.raises(StaleDescriptor, match="epoch 1 is older than the connected epoch 2"):
            a.connect(old.engine_desc())
        with pytest.raises(StaleDescriptor, match="epoch 1"):
            a.read(ma, m_old, TransferPlan([0], [0], [4096]))
        # past this side's check: a region of the new peer labelled with the old epoch
        forged = msgspec.structs.replace(m_new, epoch=1)
        with pytest.raises(StaleDescriptor):
            finish(a._transfer("read", Local(ma, ta), a.peers()["prefill-0"], forged, segments(4096)))
        finish(a.read(ma, m_new, TransferPlan([0], [0], [4096])))
        assert np.array_equal(host(ta)[:4096], pattern(2, MiB)[:4096])

    # -- timeouts and failures ------------------------------------------------------------------

    @pytest.mark.timeout(60)
    def test_wait_timeout_leaves_a_parked_transfer_running(self, harness: Harness) -> None:
        """A caller's own wait timeout ends the wait, not the transfer: held mid-way through its
        data, it is not done; released, it completes with every byte in place."""
        require_hold(harness)
        a, b, ta, ma, _, mb = pair(harness, BIG, timeout_s=TIMEOUT_S)
        x, hold = parked_read(harness, a, b, ma, mb)
        with pytest.raises(TransferTimeout):
            x.wait(0.05)
        assert not x.done()
        hold.release()
        x.wait(WAIT_S)
        assert x.done() and x.error() is None and x.bytes_moved == BIG
        segment = 64 * KiB  # big_batch: local segment i holds remote segment n - 1 - i
        expect = pattern(1, BIG).reshape(BIG // segment, segment)[::-1].reshape(-1)
        assert np.array_equal(host(ta), expect)

    @pytest.mark.timeout(60)
    def test_timeout_with_paused_peer(self, harness: Harness) -> None:
        if not harness.can_pause_peer:
            pytest.skip(
                f"backend {harness.backend!r} moves data without the owner process; pausing it stalls nothing"
            )
        a = harness.make_agent("decode-0", timeout_s=1.0)
        ta, ma = harness.region(a, BIG)
        peer = harness.spawn_peer("prefill-0", BIG, seed=5)
        a.connect(peer.desc)
        peer.pause()
        start = time.monotonic()
        x = a.read(ma, peer.mem, big_batch())
        with pytest.raises(TransferTimeout):
            x.wait(0.1)  # the caller's own timeout: the transfer goes on
        assert not x.done()
        with pytest.raises(TransferTimeout, match="timeout_s"):
            x.wait(WAIT_S)  # the transfer's deadline (1 s) ends it
        assert time.monotonic() - start < 1.0 + 2.0
        peer.resume()
        finish(a.read(ma, peer.mem, TransferPlan([0], [0], [MiB])))  # a fresh connection works again
        assert np.array_equal(host(ta)[:MiB], pattern(5, BIG)[:MiB])

    @pytest.mark.timeout(60)
    def test_peer_closed_mid_transfer_gives_peer_lost(self, harness: Harness) -> None:
        require_hold(harness)
        a, b, _, ma, _, mb = pair(harness, BIG, timeout_s=TIMEOUT_S)
        x, hold = parked_read(harness, a, b, ma, mb)
        b.close()
        hold.release()
        with pytest.raises(PeerLost):
            x.wait(TIMEOUT_S + 2.0)
        assert x.bytes_moved == 0

    @pytest.mark.timeout(90)
    def test_peer_process_killed_mid_transfer_gives_peer_lost(self, harness: Harness) -> None:
        require_peer_process(harness)
        require_hold(harness)
        a = harness.make_agent("decode-0", timeout_s=TIMEOUT_S)
        _, ma = harness.region(a, BIG)
        peer = harness.spawn_peer("prefill-0", BIG, seed=5, timeout_s=TIMEOUT_S)
        a.connect(peer.desc)
        x, hold = parked_read(harness, a, peer, ma, peer.mem)
        start = time.monotonic()
        peer.kill()
        hold.release()
        with pytest.raises(PeerLost):
            x.wait(TIMEOUT_S + 2.0)
        assert time.monotonic() - start < TIMEOUT_S
        assert x.bytes_moved == 0

    @pytest.mark.timeout(60)
    def test_disconnect_fails_in_flight_transfers(self, harness: Harness) -> None:
        require_hold(harness)
        a, b, _, ma, _, mb = pair(harness, BIG, timeout_s=TIMEOUT_S)
        x, hold = parked_read(harness, a, b, ma, mb)
        a.disconnect("prefill-0")
        with pytest.raises(PeerLost, match="disconnected"):
            x.wait(TIMEOUT_S)  # the disconnect ends it: the transfer's own deadline would say "timeout"
        hold.release()
        with pytest.raises(PeerLost):
            a.read(ma, mb, TransferPlan([0], [0], [4096]))

    # -- concurrency ----------------------------------------------------------------------------

    @pytest.mark.timeout(60)
    def test_eight_concurrent_transfers_with_two_peers(self, harness: Harness) -> None:
        a = harness.make_agent("decode-0")
        ta, ma = harness.region(a, 16 * MiB)
        peers = [harness.make_agent(f"prefill-{i}") for i in range(2)]
        regions = [harness.region(p, 8 * MiB, seed=10 + i) for i, p in enumerate(peers)]
        for p in peers:
            a.connect(p.engine_desc())
        ta.copy_(torch.from_numpy(pattern(3, 16 * MiB)))
        chunk = MiB
        xs = []
        for i in range(8):
            _, mem = regions[i % 2]
            seg = np.arange(16, dtype=np.int64) * (chunk // 16)
            sz = np.full(16, chunk // 16, dtype=np.int64)
            if i < 4:  # reads into local chunk i
                xs.append(a.read(ma, mem, TransferPlan(i * chunk + seg, i * chunk + seg, sz)))
            else:  # writes of local chunk i into the peer's chunk i
                xs.append(a.write(ma, mem, TransferPlan(i * chunk + seg, i * chunk + seg, sz)))
        for x in xs:
            x.wait(WAIT_S)
        local = host(ta)
        for i in range(4):
            expect = pattern(10 + i % 2, 8 * MiB)[i * chunk : (i + 1) * chunk]
            assert np.array_equal(local[i * chunk : (i + 1) * chunk], expect)
        for i in range(4, 8):
            remote = host(regions[i % 2][0])
            assert np.array_equal(
                remote[i * chunk : (i + 1) * chunk], pattern(3, 16 * MiB)[i * chunk : (i + 1) * chunk]
            )

    @pytest.mark.timeout(60)
    def test_one_peer_serves_several_clients_at_once(self, harness: Harness) -> None:
        peer = harness.make_agent("prefill-0")
        _, peer_mem = harness.region(peer, 8 * MiB, seed=4)
        clients = [harness.make_agent(f"decode-{i}") for i in range(3)]
        regions = [harness.region(c, 8 * MiB) for c in clients]
        for c in clients:
            c.connect(peer.engine_desc())
        sz = np.full(128, 64 * KiB, dtype=np.int64)
        order = [np.random.default_rng(i).permutation(128).astype(np.int64) * 64 * KiB for i in range(3)]
        lo = np.arange(128, dtype=np.int64) * 64 * KiB
        xs = [
            c.read(m, peer_mem, TransferPlan(lo, order[i], sz))
            for i, (c, (_, m)) in enumerate(zip(clients, regions, strict=True))
        ]
        for x in xs:
            x.wait(WAIT_S)
        rows = pattern(4, 8 * MiB).reshape(128, 64 * KiB)
        for i, (t, _) in enumerate(regions):
            assert np.array_equal(host(t).reshape(128, 64 * KiB), rows[order[i] // (64 * KiB)])


def segments(size: int) -> TransferPlan:
    """One segment at offset 0 on both sides."""
    return TransferPlan([0], [0], [size])


def random_offsets_for(rng: np.random.Generator, sizes: np.ndarray, region_bytes: int) -> np.ndarray:
    """Non-overlapping offsets for given sizes, in a random order, inside a region."""
    n = int(sizes.size)
    slack = region_bytes - int(sizes.sum())
    gaps = np.diff(np.sort(rng.integers(0, slack + 1, n + 1)))[:n]
    order = rng.permutation(n)
    starts = np.cumsum(sizes[order] + gaps) - sizes[order]
    offsets = np.empty(n, dtype=np.int64)
    offsets[order] = starts
    return offsets
