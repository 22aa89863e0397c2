"""Prefill-role leases: release frees, expiry only after lease + grace, abort frees at any stage."""

from __future__ import annotations

import time

import pytest
from engine_helpers import run_to_end, tiny_engine

from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.errors import InvalidRequest

PROMPT = list(range(30, 40))  # 10 tokens: 3 blocks of 4


@pytest.mark.timeout(30)
def test_release_frees_the_leased_blocks() -> None:
    engine = tiny_engine("prefill", num_blocks=8)
    engine.add_request("t1", PROMPT, SamplingParams())
    before = time.monotonic()
    out = run_to_end(engine)["t1"]
    handle = out.prefill
    assert out.finished and out.finish_reason is None and handle is not None
    assert handle.num_tokens == 10 and len(handle.block_ids) == 3
    assert handle.block_ids == engine.prefill_blocks("t1")
    lease = engine.allocator.get_lease("t1")
    assert lease is not None and before + 30 <= lease.deadline_s <= time.monotonic() + 30
    assert abs(handle.lease_deadline_unix - (time.time() + 30)) < 5
    stats = engine.stats()
    assert (stats["num_leased_blocks"], stats["num_used_blocks"], stats["num_free_blocks"]) == (3, 3, 5)
    assert engine.release("t1") is True
    assert engine.release("t1") is False and engine.release("unknown") is False
    assert engine.stats()["num_free_blocks"] == 8 and engine.stats()["num_leased_blocks"] == 0


@pytest.mark.timeout(30)
def test_expiry_only_after_lease_plus_grace() -> None:
    engine = tiny_engine("prefill", num_blocks=8, lease_grace_s=5.0)
    engine.add_request("t1", PROMPT, SamplingParams(), lease_s=10.0)
    handle = run_to_end(engine)["t1"].prefill
    lease = engine.allocator.get_lease("t1")
    assert handle is not None and lease is not None
    deadline = lease.deadline_s
    assert engine.sweep_leases(now_s=deadline + 1.0) == []  # past the lease, inside the grace
    assert engine.sweep_leases(now_s=deadline + 4.9) == []
    assert engine.stats()["num_leased_blocks"] == 3
    assert engine.sweep_leases(now_s=deadline + 5.1) == ["t1"]
    assert engine.stats()["num_free_blocks"] == 8 and engine.release("t1") is False


@pytest.mark.timeout(30)
def test_sweep_frees_expired_leases_and_step_leaves_them() -> None:
    engine = tiny_engine("prefill", num_blocks=8, lease_grace_s=0.0)
    engine.add_request("t1", PROMPT, SamplingParams(), lease_s=-1.0)  # already past its deadline
    run_to_end(engine)
    assert engine.stats()["num_leased_blocks"] == 3
    engine.step()  # the worker's engine loop sweeps, once per period; a step does not
    assert engine.stats()["num_leased_blocks"] == 3
    assert engine.sweep_leases() == ["t1"]
    assert engine.stats()["num_leased_blocks"] == 0 and engine.stats()["num_free_blocks"] == 8


@pytest.mark.timeout(30)
def test_abort_frees_waiting_running_and_leased() -> None:
    engine = tiny_engine("colocated", num_blocks=8)
    engine.add_request("w", PROMPT, SamplingParams(max_tokens=5))
    engine.abort("w")  # waiting
    assert engine.stats()["num_waiting"] == 0 and not engine.has_work()
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats()["num_running"] == 1 and engine.stats()["num_used_blocks"] == 3
    engine.abort("r")  # running
    engine.abort("r")
    assert engine.stats()["num_used_blocks"] == 0 and engine.stats()["num_running"] == 0
    assert engine.step() == []

    prefill = tiny_engine("prefill", num_blocks=8)
    prefill.add_request("l", PROMPT, SamplingParams())
    run_to_end(prefill)
    assert prefill.stats()["num_leased_blocks"] == 3
    prefill.abort("l")  # leased
    assert prefill.stats()["num_free_blocks"] == 8 and prefill.release("l") is False
    with pytest.raises(InvalidRequest):
        prefill.prefill_blocks("l")


@pytest.mark.timeout(30)
def test_a_leased_id_cannot_be_reused_until_released() -> None:
    engine = tiny_engine("prefill", num_blocks=8)
    engine.add_request("t1", PROMPT, SamplingParams())
    run_to_end(engine)
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request("t1", PROMPT, SamplingParams())
    engine.release("t1")
    engine.add_request("t1", PROMPT, SamplingParams())
    run_to_end(engine)
    engine.release("t1")
    assert engine.stats()["num_free_blocks"] == 8
