"""Peer failures that MoRI itself reports end in-flight transfers at once, on a FAKE ``mori``.

amd-mori 1.2.4 reports a failed peer through ``IOEngine.pop_peer_failure()`` and through sessions
that are no longer ``alive()``. The fake (``tests/unit/fake_mori.py``, checked against the real
1.2.4 surface) raises both with ``Fabric.fail_peer``. Each test bounds how long the failure takes
to surface far below ``transfer.timeout_s``, which is what would end the transfer otherwise.
"""

from __future__ import annotations

import threading
import time

import fake_mori  # tests/unit is on sys.path under pytest (no __init__.py here)
import pytest
import torch

from moriio_ray.errors import PeerLost, TransferError
from moriio_ray.transfer.plan import TransferPlan

_TIMEOUT_S = 30.0  # transfer.timeout_s: none of these tests may come near it
_FAST_S = 2.0  # a failure must surface within this, on a loaded 2-core machine


@pytest.fixture
def fabric(monkeypatch):
    return fake_mori.install(monkeypatch, immediate=False)


def _agents(*keys):
    agents = [fake_mori.make_agent(k, timeout_s=_TIMEOUT_S) for k in keys]
    d, peers = agents[0], agents[1:]
    for p in peers:
        d.connect(p.engine_desc())
    return d, peers


def _read_from(d, p):
    src = p.register(torch.arange(256, dtype=torch.uint8))
    dst = d.register(torch.zeros(256, dtype=torch.uint8))
    return d.read(dst, src, TransferPlan([0], [0], [64]))


def _wait_in_thread(transfer):
    """transfer.wait() in a thread; returns (thread, outcome, seconds it took)."""
    outcome: list[BaseException | None] = []
    took: list[float] = []

    def run():
        start = time.monotonic()
        try:
            transfer.wait(_TIMEOUT_S)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)
        took.append(time.monotonic() - start)

    thread = threading.Thread(target=run, daemon=True)  # a failing test must not hang the run
    thread.start()
    return thread, outcome, took


@pytest.mark.timeout(15)
def test_reported_peer_failure_fails_its_transfers_at_once(fabric):
    d, (p, q) = _agents("decode-0", "prefill-0", "prefill-1")
    x, y = _read_from(d, p), _read_from(d, q)
    thread, outcome, took = _wait_in_thread(x)
    assert fabric.fail_peer(p.mori_key) == 1  # d is the one engine that knows p
    thread.join(timeout=_FAST_S + 1)
    assert len(outcome) == 1 and isinstance(outcome[0], PeerLost), outcome
    assert took[0] < _FAST_S
    message = str(outcome[0])
    assert "PEER_UNREACHABLE" in message and "'prefill-0'" in message and "retry exceeded" in message
    # the other peer's transfer is untouched and still completes
    assert not y.done()
    fabric.complete()
    y.wait(timeout_s=5.0)
    assert y.error() is None
    # x's status stayed referenced until MoRI finished writing it
    assert fabric.dangling == 0 and fake_mori.live_transfers(d) == 0


@pytest.mark.timeout(15)
def test_done_alone_notices_a_reported_failure(fabric):
    d, (p,) = _agents("decode-0", "prefill-0")
    x = _read_from(d, p)
    assert not x.done()
    fabric.fail_peer(p.mori_key)
    deadline_s = time.monotonic() + _FAST_S
    while not x.done():  # a caller that polls instead of waiting
        assert time.monotonic() < deadline_s, "done() never saw the peer failure"
    assert isinstance(x.error(), PeerLost)


@pytest.mark.timeout(15)
def test_dead_session_fails_its_transfer_without_an_event(fabric):
    d, (p,) = _agents("decode-0", "prefill-0")
    x = _read_from(d, p)
    thread, outcome, took = _wait_in_thread(x)
    fabric.break_sessions(d.mori_key, p.mori_key)  # alive() turns False, pop_peer_failure stays empty
    thread.join(timeout=_FAST_S + 1)
    assert len(outcome) == 1 and isinstance(outcome[0], PeerLost), outcome
    assert took[0] < _FAST_S and "no longer alive" in str(outcome[0])


@pytest.mark.timeout(15)
def test_a_new_transfer_to_a_failed_peer_is_refused_at_once(fabric):
    d, (p,) = _agents("decode-0", "prefill-0")
    x = _read_from(d, p)
    fabric.fail_peer(p.mori_key)
    with pytest.raises(PeerLost):
        x.wait(timeout_s=_FAST_S)
    # the failed peer's cached session was dropped, and the fresh one MoRI gives is not alive either
    with pytest.raises(PeerLost, match=r"new session .* is not alive"):
        _read_from(d, p)
    assert len(fabric.methods(d.mori_key, "create_session")) == 2


@pytest.mark.timeout(15)
def test_a_local_fault_fails_every_transfer_with_a_transfer_error(fabric):
    d, (p, q) = _agents("decode-0", "prefill-0", "prefill-1")
    x, y = _read_from(d, p), _read_from(d, q)
    event = fake_mori.PeerFailureEvent(
        "", fake_mori.PeerFailureReason.LOCAL_PORT_DOWN, 0, 1, "fake_rdma0", "port went down"
    )
    fabric.push_failure(d.mori_key, event)
    for transfer in (x, y):
        with pytest.raises(TransferError) as info:
            transfer.wait(timeout_s=_FAST_S)
        assert type(info.value) is TransferError  # not PeerLost: the peers may be fine
        assert "LOCAL_PORT_DOWN" in str(info.value) and "fake_rdma0 port 1" in str(info.value)


@pytest.mark.timeout(15)
def test_a_failure_of_an_engine_we_do_not_know_changes_nothing(fabric):
    d, (p,) = _agents("decode-0", "prefill-0")
    x = _read_from(d, p)
    event = fake_mori.PeerFailureEvent(
        "gone@e1@p1", fake_mori.PeerFailureReason.PEER_UNREACHABLE, 3, 1, "fake_rdma0", "stale"
    )
    fabric.push_failure(d.mori_key, event)
    with pytest.raises(TransferError, match="did not finish within"):
        x.wait(timeout_s=0.1)  # the event was drained and ignored; x is simply still running
    assert fabric.engines[d.mori_key]._failures == type(fabric.engines[d.mori_key]._failures)()
    fabric.complete()
    x.wait(timeout_s=5.0)
    assert x.error() is None


@pytest.mark.timeout(15)
def test_failures_queued_before_a_disconnect_spare_the_reconnected_peer(fabric):
    d, (p,) = _agents("decode-0", "prefill-0")
    fabric.fail_peer(p.mori_key)
    d.disconnect(p.key)  # drains the queued event while it still belongs to this connection
    d.connect(p.engine_desc())  # the same peer, registered again: MoRI forgets its dead sessions
    x = _read_from(d, p)
    fabric.complete()
    x.wait(timeout_s=5.0)
    assert x.error() is None


@pytest.mark.timeout(15)
def test_a_generic_failure_on_a_dead_session_is_peer_lost(fabric):
    d, (p, q) = _agents("decode-0", "prefill-0", "prefill-1")
    x, y = _read_from(d, p), _read_from(d, q)
    fabric.complete(fake_mori.StatusCode.ERR_RDMA_OP, "IBV_WC_RETRY_EXC_ERR")  # the statuses fail first
    fabric.break_sessions(d.mori_key, p.mori_key)  # then MoRI marks the queue pair to p dead
    with pytest.raises(PeerLost, match=r"ERR_RDMA_OP.*IBV_WC_RETRY_EXC_ERR.*no longer alive"):
        x.wait(timeout_s=_FAST_S)
    # on q's session, still alive, the same code stays a TransferError naming MoRI's message
    with pytest.raises(TransferError) as info:
        y.wait(timeout_s=_FAST_S)
    assert type(info.value) is TransferError and "IBV_WC_RETRY_EXC_ERR" in str(info.value)
