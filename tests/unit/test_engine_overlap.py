"""Overlapped scheduling gives exactly the outputs of synchronous steps, one step later.

The engine launches step N+1 before it reads step N back, so stop checks run a step behind: a
request that a stop token, a stop string or EOS ends is fed once more (a wasted row, its token
dropped). Checked: the same tokens, finish reasons and log probabilities as synchronous steps for
many requests with content stops, length stops, seeded sampling, chunked prompts and preemption;
no output after a request ends; aborts of a request whose row is in flight; a reservation (blocks
for a transfer) waits for the step in flight; ``has_work`` until the last step is read back.
"""

from __future__ import annotations

import pytest
from engine_helpers import run_to_end, tiny_engine
from test_engine_chunked import generate, prompts

from moriio_ray.engine.engine import Engine
from moriio_ray.engine.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)


def stopping_params(reference: dict, count: int) -> list[SamplingParams]:
    """Per request: a stop token it meets part-way, a stop string, EOS, or only max_tokens."""
    params = []
    for i in range(count):
        tokens = reference[f"r{i}"][0]
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(max_tokens=20, stop_token_ids=[tokens[3 + i % 7]], logprobs=True))
        elif kind == 1:  # a stop string: the text of a printable byte it produces part-way
            text = next((chr(t) for t in tokens[2:] if 32 < t < 127), "never-there")
            params.append(SamplingParams(max_tokens=20, stop=[text], ignore_eos=True))
        elif kind == 2:
            params.append(SamplingParams(max_tokens=20, temperature=1.2, seed=i, ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=1 + i % 5, ignore_eos=True, logprobs=True))
    return params


@pytest.mark.parametrize(("budget", "num_blocks"), [(4096, 256), (9, 256), (11, 18)])
def test_overlapped_steps_give_the_synchronous_outputs(budget: int, num_blocks: int) -> None:
    ps = prompts(20, seed=11, longest=40)
    plain = generate(tiny_engine(), ps, [SamplingParams(max_tokens=20, ignore_eos=True)] * len(ps))
    params = stopping_params(plain, len(ps))
    kw = {"max_num_seqs": 8, "max_num_batched_tokens": max(budget, 8), "num_blocks": num_blocks}
    sync = tiny_engine(**kw)
    overlap = tiny_engine(**kw, overlap=True)
    assert overlap.overlap and not sync.overlap
    want = generate(sync, ps, params)
    assert generate(overlap, ps, params) == want
    reasons = [want[f"r{i}"][1] for i in range(len(ps))]
    assert reasons.count("stop") >= 8 and reasons.count("length") >= 5
    assert min(len(want[f"r{i}"][0]) for i in range(0, len(ps), 4)) < 20  # stopped part-way
    if num_blocks < 256:
        assert overlap.stats()["num_preemptions"] > 0


def test_outputs_lag_one_step_and_has_work_lasts_until_the_last_read_back() -> None:
    engine = tiny_engine(overlap=True)
    assert engine.step() == [] and not engine.has_work()  # idle
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    assert engine.step() == []  # the prefill is launched; its first token is read back next time
    assert [o.new_token_ids for o in engine.step()] != []
    (second,) = engine.step()
    assert not second.finished and engine.has_work()
    (last,) = engine.step()  # nothing left to launch: only the read-back
    assert last.finished and last.finish_reason == "length" and not engine.has_work()
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]


def _find(engine: Engine, rid: str):  # type: ignore[no-untyped-def]
    return engine._seqs[rid]


def test_a_request_ended_by_a_stop_token_is_fed_once_more_and_emits_nothing_after() -> None:
    plain = run_to_end_tokens(tiny_engine(), [9, 8, 7], SamplingParams(max_tokens=12, ignore_eos=True))
    stop = plain[4]
    k = plain.index(stop)
    engine = tiny_engine(overlap=True, num_blocks=16)
    engine.add_request("r", [9, 8, 7], SamplingParams(max_tokens=12, stop_token_ids=[stop]))
    steps = []
    run = engine.runner.run

    def recording(batch, *args):  # type: ignore[no-untyped-def]
        steps.append(len(batch.seqs))
        return run(batch, *args)

    engine.runner.run = recording  # type: ignore[method-assign]
    result = run_to_end(engine)["r"]
    assert result.tokens == plain[: k + 1] and result.finish_reason == "stop"
    assert len(steps) == k + 2  # the prefill, k decodes, and one wasted row after the stop token
    assert engine.stats()["num_free_blocks"] == 16


def run_to_end_tokens(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    engine.add_request("r", prompt, params)
    return run_to_end(engine)["r"].tokens


def test_an_abort_while_its_row_is_in_flight() -> None:
    engine = tiny_engine(overlap=True, num_blocks=16)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.add_request("a", list(range(10, 22)), params)
    engine.add_request("b", [3, 4], params)
    engine.step()
    engine.step()  # a's and b's first decodes in flight; their first tokens read back
    engine.abort("a")
    assert engine.stats()["num_used_blocks"] == 1  # b's; a's are free at once (later steps may
    # reuse them: the device runs steps in order)
    outputs = engine.step()
    assert {o.request_id for o in outputs} == {"b"}
    rest = run_to_end(engine)
    assert set(rest) == {"b"} and rest["b"].finished
    assert engine.stats()["num_free_blocks"] == 16


def test_a_reservation_waits_until_the_device_has_run_the_step_in_flight() -> None:
    """Blocks that a transfer will write must not be written by a step still on the device."""
    engine = tiny_engine("decode", overlap=True, num_blocks=16)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    assert engine.reserve("a", [1, 2, 3], params) is not None
    engine.start_decode("a", 7)
    engine.step()
    in_flight = engine._in_flight
    assert in_flight is not None
    waited = []
    in_flight.wait = lambda: waited.append(True)  # type: ignore[method-assign]
    assert engine.reserve("b", [4, 5], params) is not None
    assert waited == [True]
    engine.abort("a")
    engine.abort("b")
    run_to_end(engine)
    assert engine.stats()["num_free_blocks"] == 16


def test_rows_of_a_preempted_request_are_dropped_even_once_it_runs_again() -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = run_to_end_tokens(tiny_engine(), [9, 8, 7], params)
    engine = tiny_engine(overlap=True)
    engine.add_request("r", [9, 8, 7], params)
    assert engine.step() == []  # its prefill in flight
    seq = _find(engine, "r")
    engine.scheduler.preempt(seq)  # as the scheduler does when blocks run out
    # the next step admits it again (a fresh prefill) before the first one is read back
    assert engine.step() == [] and seq.num_cached == 3
    assert run_to_end(engine)["r"].tokens == want


def test_heavy_preemption_makes_progress_and_gives_the_synchronous_tokens() -> None:
    """32 requests of 128 tokens each over 256 blocks of 4 (a quarter of what they need): freed
    blocks are reusable by the next step at once, so preemption frees what it takes."""
    outs = []
    for overlap in (False, True):
        engine = tiny_engine(overlap=overlap)
        for i in range(32):
            engine.add_request(f"r{i}", [5 + i % 50] * 64, SamplingParams(max_tokens=64, ignore_eos=True))
        results = run_to_end(engine, max_steps=3000)
        assert engine.stats()["num_preemptions"] > 0
        outs.append({rid: r.tokens for rid, r in results.items()})
    assert outs[0] == outs[1] and all(len(t) == 64 for t in outs[0].values())


def test_no_output_for_a_request_aborted_after_its_sampling_failed(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from moriio_ray.engine import sampler

    real = sampler._filter

    def failing(scaled, rows):  # type: ignore[no-untyped-def]
        if any(r.top_k == 7 for r in rows):
            raise IndexError("injected")
        return real(scaled, rows)

    monkeypatch.setattr(sampler, "_filter", failing)
    engine = tiny_engine(overlap=True)
    engine.add_request("bad", [5, 6, 7], SamplingParams(max_tokens=4, temperature=1.0, top_k=7, seed=1))
    assert engine.step() == []  # launched: its sampling failed, the request ended at once
    engine.abort("bad")  # the caller cancels before the step is read back
    assert run_to_end(engine) == {}
    engine.add_request("bad2", [5, 6, 7], SamplingParams(max_tokens=4, temperature=1.0, top_k=7, seed=1))
    results = run_to_end(engine)  # not aborted: its failure comes out
    assert results["bad2"].finished and results["bad2"].tokens == []
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]
