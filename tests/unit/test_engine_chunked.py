"""Chunked prefill and mixed steps give exactly the tokens of whole-prompt, separate steps.

Many concurrent requests of varied lengths, greedy and seeded; budgets that split blocks (blocks of
4 tokens); preemption; aborts mid-prefill; a prefill engine that leases a prompt only once its last
chunk ran; a decode engine's recompute in chunks. Each case also checks that chunks and mixed
steps really happened, and that every block comes back.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from engine_helpers import BLOCK_SIZE, disaggregated, run_to_end, tiny_engine, with_first

from moriio_ray.engine.batch import PrefillChunk
from moriio_ray.engine.engine import Engine, StepOutput
from moriio_ray.engine.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=True)


def prompts(count: int, seed: int, longest: int = 70) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, BLOCK_SIZE, 2 * BLOCK_SIZE + 1, longest]
    lengths += torch.randint(2, longest, (count - len(lengths),), generator=gen).tolist()
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def params_for(count: int) -> list[SamplingParams]:
    """Greedy and seeded sampling, alternating."""
    return [
        GREEDY if i % 2 else SamplingParams(max_tokens=9, temperature=1.5, top_p=0.9, seed=i, ignore_eos=True)
        for i in range(count)
    ]


def record_steps(engine: Engine) -> list[tuple[int, list[int]]]:
    """Every step's (number of decode rows, new tokens per row), as the runner sees it."""
    steps: list[tuple[int, list[int]]] = []
    run = engine.runner.run

    def recording(batch, *args):  # type: ignore[no-untyped-def]
        steps.append((batch.num_decodes, list(batch.q_lens)))
        return run(batch, *args)

    engine.runner.run = recording  # type: ignore[method-assign]
    return steps


class Out(tuple):
    """(tokens, finish reason, log probabilities): equal when the tokens and reason are, and the
    log probabilities agree to float rounding (batch shapes change the summation order)."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, tuple) or self[:2] != other[:2] or len(self[2]) != len(other[2]):
            return False
        return all(abs(a - b) < 1e-4 for a, b in zip(self[2], other[2], strict=True))

    __hash__ = tuple.__hash__


def outs(results: dict) -> dict[str, Out]:
    return {rid: Out((r.tokens, r.finish_reason, r.logprobs)) for rid, r in results.items()}


def generate(engine: Engine, ps: list[list[int]], params: list[SamplingParams]) -> dict[str, Out]:
    start = engine.stats()
    for i, (prompt, p) in enumerate(zip(ps, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    results = outs(run_to_end(engine))
    assert engine.stats() | {"num_preemptions": 0} == start | {"num_preemptions": 0}
    return results


@pytest.mark.parametrize("budget", [8, 13, 37])
@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill_gives_the_unchunked_tokens(budget: int, overlap: bool) -> None:
    ps = prompts(24, seed=1)
    params = params_for(len(ps))
    want = generate(tiny_engine(max_num_seqs=8), ps, params)
    engine = tiny_engine(max_num_seqs=8, max_num_batched_tokens=budget, overlap=overlap)
    steps = record_steps(engine)
    assert generate(engine, ps, params) == want
    assert all(sum(q) <= budget and len(q) <= 8 for _, q in steps)
    chunks = [n for nd, q in steps for n in q[nd:]]
    assert any(n % BLOCK_SIZE for n in chunks) and max(chunks) <= budget  # chunks split blocks
    assert any(nd and nd < len(q) for nd, q in steps)  # mixed steps: decodes and prefill chunks


def test_unchunked_prompts_run_whole_and_alone_past_the_budget() -> None:
    ps = prompts(10, seed=2)
    params = params_for(len(ps))
    want = generate(tiny_engine(), ps, params)
    engine = tiny_engine(max_num_seqs=8, max_num_batched_tokens=16, chunked_prefill=False)
    steps = record_steps(engine)
    assert generate(engine, ps, params) == want
    fed = [q[nd:] for nd, q in steps]
    assert sorted(n for q in fed for n in q) == sorted(len(p) for p in ps)  # each prompt in one piece
    assert all(sum(q) <= 16 or len(q) == 1 for q in fed)  # past the budget only alone


def test_mixed_steps_give_the_tokens_of_separate_steps() -> None:
    """Requests run one at a time (their prefill steps hold nothing else) against together."""
    ps = prompts(12, seed=3)
    params = params_for(len(ps))
    alone: dict[str, Out] = {}
    engine = tiny_engine()
    for i, (prompt, p) in enumerate(zip(ps, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
        alone.update(outs(run_to_end(engine)))
    together = tiny_engine(max_num_seqs=4, max_num_batched_tokens=20)
    steps = record_steps(together)
    assert generate(together, ps, params) == alone
    assert sum(1 for nd, q in steps if 0 < nd < len(q)) >= 5


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_with_chunks_recomputes_the_same_tokens(overlap: bool) -> None:
    ps = prompts(12, seed=4, longest=40)
    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * len(ps)
    want = generate(tiny_engine(), ps, params)
    # 16 blocks of 4 tokens: the longest request needs 14, so running ones get preempted
    engine = tiny_engine(num_blocks=16, max_num_seqs=6, max_num_batched_tokens=11, overlap=overlap)
    assert generate(engine, ps, params) == want
    assert engine.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_mid_prefill_frees_everything_and_spares_the_others(overlap: bool) -> None:
    ps = prompts(6, seed=5)
    params = [GREEDY] * len(ps)
    want = generate(tiny_engine(), ps[:5], params[:5])
    engine = tiny_engine(max_num_seqs=8, max_num_batched_tokens=9, overlap=overlap)
    start = engine.stats()
    long = list(range(40, 100))  # 60 tokens: seven steps of chunks at most 9
    engine.add_request("long", long, GREEDY)
    for i, (prompt, p) in enumerate(zip(ps[:5], params[:5], strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    outputs = engine.step() + engine.step()
    seq = engine._seqs["long"]
    assert 0 < seq.num_cached < len(long)  # part-way through its prompt
    engine.abort("long")
    results = run_to_end(engine)
    assert "long" not in results and all(o.request_id != "long" for o in outputs)
    got = {rid: (r.tokens, r.finish_reason) for rid, r in results.items()}
    for o in outputs:  # the first two steps' outputs (first tokens)
        got[o.request_id] = (o.new_token_ids + got[o.request_id][0], got[o.request_id][1])
    assert got == {rid: (t, reason) for rid, (t, reason, _) in want.items()}
    assert engine.stats() | {"num_preemptions": 0} == start | {"num_preemptions": 0}


def test_a_prefill_engine_leases_a_prompt_once_its_last_chunk_ran() -> None:
    prefill = tiny_engine("prefill", max_num_seqs=2, max_num_batched_tokens=6)
    prompt = list(range(50, 73))  # 23 tokens: chunks of 6, 6, 6, 5
    prefill.add_request("r", prompt, GREEDY)
    steps = record_steps(prefill)
    for _ in range(3):
        assert prefill.step() == [] and prefill.stats()["num_leased_blocks"] == 0
    (out,) = prefill.step()
    assert [q for _, q in steps] == [[6], [6], [6], [5]]
    assert out.finished and out.prefill is not None and out.prefill.num_tokens == 23
    assert out.prefill.block_ids == prefill.prefill_blocks("r") and len(out.prefill.block_ids) == 6
    assert prefill.stats()["num_leased_blocks"] == 6 and not prefill.has_work()
    assert prefill.release("r") and prefill.stats()["num_free_blocks"] == prefill.stats()["num_blocks"]
    # cancelled mid-chunking: no lease, every block free
    prefill.add_request("c", prompt, GREEDY)
    prefill.step()
    assert prefill.stats()["num_used_blocks"] == 6
    prefill.abort("c")
    assert prefill.stats()["num_free_blocks"] == prefill.stats()["num_blocks"] and not prefill.has_work()


@pytest.mark.parametrize("budget", [6, 22, 23])
def test_the_layer_hook_sees_every_prompt_token_in_a_prefill_chunk(budget: int) -> None:
    # 23 tokens: a budget of 22 (or 6: chunks of 6, 6, 6, 5, with a 1-token prompt beside it that
    # takes one token of a step) can leave a prompt one token short of its end; that token is still
    # a prompt token, fed in a prefill chunk that the hook sees (a WRITE push waits for the last one)
    prefill = tiny_engine("prefill", max_num_seqs=4, max_num_batched_tokens=budget)
    seen: dict[str, list[tuple[int, int]]] = {}

    def hook(layer: int, chunks: list[PrefillChunk]) -> None:
        for c in chunks:
            if layer == 0:
                seen.setdefault(c.request_id, []).append((c.start, c.end))

    prefill.set_layer_hook(hook)
    prompts = {"a": list(range(50, 73)), "b": [7], "c": list(range(10, 33))}
    for rid, prompt in prompts.items():
        prefill.add_request(rid, prompt, GREEDY)
    finished = {o.request_id for o in run_to_end_outputs(prefill)}
    assert finished == set(prompts)
    for rid, prompt in prompts.items():
        spans = seen[rid]
        assert spans[0][0] == 0 and spans[-1][1] == len(prompt), (rid, spans)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), (rid, spans)
        assert PrefillChunk(rid, *spans[-1], len(prompt)).is_last


def run_to_end_outputs(engine: Engine) -> list[StepOutput]:
    outputs: list[StepOutput] = []
    for _ in range(100):
        outputs += engine.step()
        if not engine.has_work():
            return outputs
    raise AssertionError("the engine did not finish in 100 steps")


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prefill_and_decode_engines_give_the_colocated_tokens(overlap: bool) -> None:
    ps = prompts(16, seed=6)
    params = params_for(len(ps))
    want = generate(tiny_engine(), ps, params)
    prefill = tiny_engine("prefill", max_num_seqs=4, max_num_batched_tokens=10, overlap=overlap)
    decode = tiny_engine("decode", max_num_seqs=8, max_num_batched_tokens=8, overlap=overlap)
    got = disaggregated(prefill, decode, ps, params)
    assert {rid: (r.tokens, r.finish_reason) for rid, r in got.items()} == {
        rid: (t, reason) for rid, (t, reason, _) in want.items()
    }


@pytest.mark.parametrize("overlap", [False, True])
def test_a_decode_engines_recompute_runs_in_chunks(overlap: bool) -> None:
    ps = prompts(6, seed=7)
    params = params_for(len(ps))
    want = generate(tiny_engine(), ps, params)
    prefill = tiny_engine("prefill")
    decode = tiny_engine("decode", max_num_seqs=4, max_num_batched_tokens=7, overlap=overlap)
    for i, (prompt, p) in enumerate(zip(ps, params, strict=True)):
        prefill.add_request(f"r{i}", prompt, p)
    firsts = run_to_end(prefill)
    for i, (prompt, p) in enumerate(zip(ps, params, strict=True)):
        rid = f"r{i}"
        assert prefill.release(rid) and decode.reserve(rid, prompt, p) is not None
        decode.recompute_reserved(rid, firsts[rid].prefill.first_token)  # type: ignore[union-attr]
    steps = record_steps(decode)
    rest = run_to_end(decode)
    got = {rid: with_first(firsts[rid], rest[rid]) for rid in firsts}
    assert {rid: (r.tokens, r.finish_reason) for rid, r in got.items()} == {
        rid: (t, reason) for rid, (t, reason, _) in want.items()
    }
    assert max(len(q) - nd for nd, q in steps) >= 1 and max(max(q) for _, q in steps) == 7  # chunks
    assert decode.stats()["num_free_blocks"] == decode.stats()["num_blocks"]
