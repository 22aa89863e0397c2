"""Running out of blocks: queue, preempt + recompute (same greedy tokens), CapacityError for a
request that can never fit, and counters back at their start values afterwards."""

from __future__ import annotations

import pytest
from engine_helpers import BLOCK_SIZE, prompts_for_block_size, run_to_end, tiny_engine

from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.errors import CapacityError, InvalidRequest

PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


def _run(engine, prompts, params=PARAMS):
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    peak_waiting = 0
    results = {}
    while engine.has_work():
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
        peak_waiting = max(peak_waiting, engine.stats()["num_waiting"])
    return results, peak_waiting


@pytest.mark.timeout(60)
def test_queue_then_preempt_and_recompute_give_the_same_tokens() -> None:
    prompts = prompts_for_block_size(BLOCK_SIZE, count=12, seed=3)
    want, _ = _run(tiny_engine(num_blocks=512), prompts)
    # 14 blocks of 4 tokens: the longest request needs 9, so some queue and running ones get preempted
    small = tiny_engine(num_blocks=14)
    start = small.stats()
    got, peak_waiting = _run(small, prompts)
    assert got == want
    assert peak_waiting > 0
    assert small.stats()["num_preemptions"] > 0
    end = small.stats()
    assert {k: v for k, v in end.items() if k != "num_preemptions"} == {
        k: v for k, v in start.items() if k != "num_preemptions"
    }


@pytest.mark.timeout(60)
def test_a_step_holds_the_decodes_then_prefill_chunks_up_to_the_budget() -> None:
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    want, _ = _run(tiny_engine(), [[7 + i] * 8 for i in range(6)], params)
    engine = tiny_engine(max_num_seqs=3, max_num_batched_tokens=20)
    steps: list[tuple[int, list[int]]] = []
    run = engine.runner.run

    def recording_run(batch, *args):
        steps.append((batch.num_decodes, list(batch.q_lens)))
        return run(batch, *args)

    engine.runner.run = recording_run  # type: ignore[method-assign]
    got, _ = _run(engine, [[7 + i] * 8 for i in range(6)], params)
    assert got == want and all(len(t) == 3 for t in got.values())
    assert steps[0] == (0, [8, 8, 4])  # the third prompt's first chunk fills the budget
    assert steps[1] == (2, [1, 1, 4])  # its rest rides along with the first two's decodes
    assert all(sum(q) <= 20 and len(q) <= 3 for _, q in steps)  # the budget, max_num_seqs
    assert engine.stats()["num_used_blocks"] == 0


@pytest.mark.timeout(30)
def test_never_fitting_requests_raise_capacity_error() -> None:
    engine = tiny_engine(num_blocks=4, max_model_len=64)  # 16 cached tokens at most
    start = engine.stats()
    with pytest.raises(CapacityError, match="KV blocks"):
        engine.add_request("a", [1] * 17, SamplingParams(max_tokens=1))
    with pytest.raises(CapacityError, match="KV blocks"):
        engine.add_request("b", [1] * 10, SamplingParams(max_tokens=8))  # 17 tokens cached at most
    engine.add_request("c", [1] * 10, SamplingParams(max_tokens=7))  # exactly 16 cached: fits
    with pytest.raises(CapacityError, match="max_model_len"):
        engine.add_request("d", [1] * 64, SamplingParams(max_tokens=1))
    with pytest.raises(CapacityError):
        engine.reserve("e", [1] * 17, SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequest):
        engine.add_request("f", [], SamplingParams())
    with pytest.raises(InvalidRequest):
        engine.add_request("g", [300], SamplingParams())  # outside the vocabulary
    with pytest.raises(InvalidRequest):
        engine.add_request("c", [1], SamplingParams())  # duplicate id
    assert run_to_end(engine)["c"].finish_reason == "length"
    assert engine.stats() == start


@pytest.mark.timeout(30)
def test_prefill_role_needs_only_prompt_blocks_and_queues_behind_leases() -> None:
    engine = tiny_engine("prefill", num_blocks=4)
    engine.add_request("a", [1] * 16, SamplingParams(max_tokens=100))  # D's problem, not P's
    assert run_to_end(engine)["a"].prefill is not None
    assert engine.stats()["num_leased_blocks"] == 4
    engine.add_request("b", [2] * 5, SamplingParams())
    assert engine.step() == [] and engine.stats()["num_waiting"] == 1  # all blocks leased: it queues
    assert not engine.has_work()  # nothing to do until a lease goes
    assert engine.release("a")
    assert engine.has_work()
    assert run_to_end(engine)["b"].prefill.block_ids  # type: ignore[union-attr]
    assert engine.release("b") and engine.stats()["num_free_blocks"] == 4


@pytest.mark.timeout(30)
def test_reserve_returns_none_when_short_and_counts_stay_exact() -> None:
    engine = tiny_engine("decode", num_blocks=6)
    params = SamplingParams(max_tokens=2)
    assert engine.reserve("a", [1] * 16, params) == [0, 1, 2, 3]
    assert engine.reserve("b", [1] * 9, params) is None  # needs 3, 2 free
    assert engine.stats()["num_reserved"] == 1 and engine.stats()["num_free_blocks"] == 2
    engine.abort("a")
    assert engine.reserve("b", [1] * 9, params) is not None
    engine.abort("b")
    engine.abort("b")  # idempotent
    assert engine.stats()["num_free_blocks"] == 6 and engine.stats()["num_reserved"] == 0
