"""MoRI statuses -> our errors, waiting with deadlines, and keeping statuses alive, on a FAKE ``mori``.

The fake (``tests/unit/fake_mori.py``) stands in for ``mori.io`` because there is no AMD hardware
here and the real ``amd-mori`` wheels are cp310/ROCm only. Like MoRI's C++ side, it holds statuses
by weak reference and counts completions of statuses Python already freed (``dangling``).
"""

from __future__ import annotations

import gc
import threading
import weakref

import fake_mori  # tests/unit is on sys.path under pytest (no __init__.py here)
import pytest
import torch

from moriio_ray.errors import PeerLost, SegmentOutOfBounds, TransferError, TransferTimeout
from moriio_ray.transfer.mori_status import status_error
from moriio_ray.transfer.plan import TransferPlan

SC = fake_mori.StatusCode


@pytest.fixture
def fabric(monkeypatch):
    return fake_mori.install(monkeypatch, immediate=False)


def _setup(timeout_s=10.0):
    p = fake_mori.make_agent("prefill-0", timeout_s=timeout_s)
    d = fake_mori.make_agent("decode-0", timeout_s=timeout_s)
    d.connect(p.engine_desc())
    src = torch.arange(256, dtype=torch.uint8).repeat(4)
    dst = torch.zeros(1024, dtype=torch.uint8)
    return p, d, src, dst, p.register(src), d.register(dst)


def _wait_in_thread(transfer, timeout_s):
    """Run transfer.wait in a thread; returns (thread, outcome list)."""
    outcome: list[BaseException | None] = []

    def run():
        try:
            transfer.wait(timeout_s)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("code", "error"),
    [
        (SC.ERR_INVALID_ARGS, SegmentOutOfBounds),
        (SC.ERR_RDMA_OP, TransferError),
        (SC.ERR_BAD_STATE, TransferError),
        (SC.ERR_GPU_OP, TransferError),
    ],
)
def test_failure_codes_raise_typed_errors_with_moris_message(fabric, code, error):
    _, d, _, _, p_mem, d_mem = _setup()
    fabric.fail_next = (code, "ibv_post_send: Cannot allocate memory")
    x = d.read(d_mem, p_mem, TransferPlan([0], [0], [16]))
    assert x.done()
    with pytest.raises(TransferError) as info:
        x.wait(timeout_s=1.0)
    assert type(info.value) is error
    assert code.name in str(info.value) and "Cannot allocate memory" in str(info.value)
    assert "prefill-0" in str(info.value)


@pytest.mark.timeout(10)
def test_not_found_means_the_peer_is_gone(fabric):
    p, d, _, _, p_mem, d_mem = _setup()
    p.deregister(p_mem)  # MoRI no longer knows the remote region
    x = d.read(d_mem, p_mem, TransferPlan([0], [0], [16]))
    with pytest.raises(PeerLost, match=r"ERR_NOT_FOUND.*reconnect"):
        x.wait(timeout_s=1.0)


@pytest.mark.timeout(10)
def test_unknown_code_still_names_itself():
    class _Status:
        def Code(self):
            return "StatusCode.ERR_FROM_A_NEWER_MORI"

        def Message(self):
            return ""

    error = status_error(_Status(), "peer-x")
    assert type(error) is TransferError
    assert "ERR_FROM_A_NEWER_MORI" in str(error) and "no message" in str(error)


@pytest.mark.timeout(10)
def test_wait_times_out_then_the_transfer_goes_on(fabric):
    _, d, src, dst, p_mem, d_mem = _setup()
    x = d.read(d_mem, p_mem, TransferPlan([0], [512], [256]))
    with pytest.raises(TransferTimeout, match=r"256 bytes in 1 segments.*within 0.05 s; it goes on"):
        x.wait(timeout_s=0.05)
    assert not x.done() and x.error() is None
    assert fabric.complete() == 1
    x.wait(timeout_s=1.0)
    assert torch.equal(dst[:256], src[512:768])


@pytest.mark.timeout(10)
def test_waiter_wakes_on_completion_from_another_thread(fabric):
    _, d, _, _, p_mem, d_mem = _setup()
    x = d.read(d_mem, p_mem, TransferPlan([0], [0], [64]))
    thread, outcome = _wait_in_thread(x, 5.0)
    fabric.complete()
    thread.join(timeout=5.0)
    assert outcome == [None]


@pytest.mark.timeout(10)
def test_wait_goes_through_wait_all_in_short_slices(fabric):
    _, d, _, _, p_mem, d_mem = _setup()
    x = d.read(d_mem, p_mem, TransferPlan([0], [0], [64]))
    with pytest.raises(TransferTimeout):
        x.wait(timeout_s=0.12)
    waits = fabric.methods(d.mori_key, "wait_all")
    # one status per batch, and no slice longer than 50 ms, so a peer failure is seen quickly
    assert len(waits) >= 2 and all(n == 1 and 1 <= ms <= 50 for n, ms in waits)
    fabric.complete()
    x.wait(timeout_s=1.0)


@pytest.mark.timeout(10)
def test_statuses_stay_alive_until_terminal_after_the_caller_drops_them(fabric):
    _, d, _, _, p_mem, d_mem = _setup()
    x = d.read(d_mem, p_mem, TransferPlan([0], [0], [64]))
    status_ref = weakref.ref(x.statuses[0])
    del x
    gc.collect()
    assert status_ref() is not None and fake_mori.live_transfers(d) == 1
    fabric.complete()
    assert fabric.dangling == 0
    assert fake_mori.live_transfers(d) == 0
    gc.collect()
    assert status_ref() is None


@pytest.mark.timeout(10)
def test_the_fake_detects_a_freed_status(fabric):
    # Control for the test above: without the agent's reference, completion would dangle.
    p, d, _, _, p_mem, d_mem = _setup()
    session, _ = d._session(d_mem, p_mem, d.peers()[p.key])
    session.batch_read([0], [0], [64], session.allocate_transfer_uid())
    gc.collect()
    fabric.complete()
    assert fabric.dangling == 1


@pytest.mark.timeout(10)
def test_disconnect_fails_in_flight_transfers_and_keeps_their_statuses(fabric):
    p, d, _, _, p_mem, d_mem = _setup()
    x = d.read(d_mem, p_mem, TransferPlan([0], [0], [64]))
    thread, outcome = _wait_in_thread(x, 5.0)
    d.disconnect(p.key)
    thread.join(timeout=5.0)
    assert len(outcome) == 1 and isinstance(outcome[0], PeerLost)
    assert x.done() and isinstance(x.error(), PeerLost)
    del x
    gc.collect()
    assert fake_mori.live_transfers(d) == 1  # MoRI may still write the status
    fabric.complete()
    assert fabric.dangling == 0 and fake_mori.live_transfers(d) == 0


@pytest.mark.timeout(10)
def test_close_keeps_the_engine_while_statuses_are_live(fabric):
    _, d, _, _, p_mem, d_mem = _setup()
    x = d.read(d_mem, p_mem, TransferPlan([0], [0], [64]))
    d.close()
    assert isinstance(x.error(), PeerLost)
    assert isinstance(d._engine, fake_mori.IOEngine)
    fabric.complete()
    assert fabric.dangling == 0


@pytest.mark.timeout(10)
def test_a_lost_completion_ends_at_the_transfer_deadline(fabric):
    _, d, _, _, p_mem, d_mem = _setup(timeout_s=0.2)
    x = d.read(d_mem, p_mem, TransferPlan([0], [0], [64]))
    with pytest.raises(TransferTimeout, match=r"deadline \(transfer.timeout_s = 0.2 s\)"):
        x.wait()  # no caller timeout: MoRI never completes, the transfer's own deadline ends it
    assert x.done() and isinstance(x.error(), TransferTimeout) and x.bytes_moved == 0
    assert fake_mori.live_transfers(d) == 1  # the status is still MoRI's to write
    fabric.complete()
    assert fabric.dangling == 0 and fake_mori.live_transfers(d) == 0
    assert isinstance(x.error(), TransferTimeout)  # a late completion does not revive it
