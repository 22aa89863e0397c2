"""Logit shaping (penalties, logit_bias, min_tokens) and top-k logprobs in the engine: against a
per-row reference, in colocated, overlapped and disaggregated engines alike."""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import disaggregated, prompts_for_block_size, run_to_end, tiny_engine

from moriio_ray.engine import grammar
from moriio_ray.engine.engine import Engine
from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.engine.sequence import Sequence
from moriio_ray.engine.shaping import apply_shaping, plan_shaping
from moriio_ray.errors import InvalidRequest


def _reference(logits: torch.Tensor, seqs: list[Sequence], pending: list[int | None], eos: list[int]):
    """The definitions, one row and one token at a time."""
    out = logits.clone()
    for i, seq in enumerate(seqs):
        p = seq.params
        outputs = list(seq.output_ids) + ([pending[i]] if pending[i] is not None else [])
        if p.repetition_penalty != 1.0:
            for t in set(seq.prompt_ids) | set(outputs):
                v = out[i, t]
                out[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t in set(outputs):
            out[i, t] -= p.frequency_penalty * outputs.count(t) + p.presence_penalty
        for t, b in p.logit_bias.items():
            out[i, t] += b
        if len(outputs) < p.min_tokens:
            for t in list(p.stop_token_ids) + ([] if p.ignore_eos else eos):
                out[i, t] = float("-inf")
    return out


@pytest.mark.timeout(30)
def test_shaping_matches_the_per_row_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 50
    params = [
        SamplingParams(),  # no shaping: untouched
        SamplingParams(presence_penalty=0.5, frequency_penalty=1.5, max_tokens=20),
        SamplingParams(repetition_penalty=1.3, logit_bias={3: -100.0, 7: 5.5}),
        SamplingParams(min_tokens=5, max_tokens=9, stop_token_ids=[11], frequency_penalty=-0.7),
        SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[12], repetition_penalty=0.8),
    ]
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(f"r{i}", torch.randint(0, vocab, (6,), generator=gen).tolist(), p, seed=0)
        seq.output_ids = torch.randint(0, vocab, (i + 1,), generator=gen).tolist()
        seqs.append(seq)
    # rows 1 and 4 have a token still on the device (overlapped scheduling), at index 2 and 0
    prev = torch.tensor([9, 4, 33], dtype=torch.int64)
    seqs[1].num_pending, seqs[1].pending_row = 1, 2
    seqs[4].num_pending, seqs[4].pending_row = 1, 0
    logits = torch.randn(len(seqs), vocab, generator=gen) * 3
    plan = plan_shaping(seqs, [0, 1])
    assert plan is not None
    got = apply_shaping(logits.clone(), plan, prev)
    want = _reference(logits, seqs, [None, 33, None, None, 9], [0, 1])
    torch.testing.assert_close(got, want)
    assert torch.equal(got[0], logits[0])
    assert plan_shaping(seqs[:1], [0]) is None  # no row shapes: nothing to do


def _greedy(engine: Engine, prompt: list[int], **kw: object) -> list[int]:
    engine.add_request("x", prompt, SamplingParams(max_tokens=24, ignore_eos=True, **kw))  # type: ignore[arg-type]
    return run_to_end(engine)["x"].tokens


@pytest.mark.timeout(60)
def test_penalties_reduce_repetition_and_bias_moves_the_first_token() -> None:
    engine = tiny_engine()
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7]
    plain = _greedy(engine, prompt)
    assert len(set(plain)) < len(plain) // 2, f"the greedy output should repeat: {plain}"
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 5.0}):
        penalized = _greedy(engine, prompt, **kw)
        assert len(set(penalized)) > len(set(plain)), (kw, plain, penalized)
    banned = _greedy(engine, prompt, logit_bias={plain[0]: -100.0})
    assert banned[0] != plain[0]
    forced = _greedy(engine, prompt, logit_bias={42: 100.0})
    assert forced == [42] * 24


@pytest.mark.timeout(60)
def test_min_tokens_masks_stop_ids_and_eos_until_reached() -> None:
    engine = tiny_engine()
    prompt = [1, 2, 3, 4]
    first = _greedy(engine, prompt)[0]
    engine.add_request("a", prompt, SamplingParams(max_tokens=10, stop_token_ids=[first]))
    engine.add_request("b", prompt, SamplingParams(max_tokens=10, stop_token_ids=[first], min_tokens=4))
    out = run_to_end(engine)
    assert out["a"].tokens == [first] and out["a"].finish_reason == "stop"
    assert len(out["b"].tokens) >= 5 and first not in out["b"].tokens[:4]
    eos = engine.tokenizer.eos_token_ids[0]
    forced_eos = {eos: 100.0}
    engine.add_request("c", prompt, SamplingParams(max_tokens=10, logit_bias=forced_eos, min_tokens=3))
    out = run_to_end(engine)
    # min_tokens tokens come before EOS may: it is the fourth
    assert len(out["c"].tokens) == 4 and out["c"].tokens[-1] == eos and eos not in out["c"].tokens[:3]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "bad",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3},
        {"repetition_penalty": 0.0},
        {"logit_bias": {1: 101.0}},
        {"logit_bias": {-1: 1.0}},
        {"min_tokens": 17},
        {"top_logprobs": 21},
    ],
)
def test_shaping_bounds(bad: dict) -> None:
    with pytest.raises(InvalidRequest, match=next(iter(bad))):
        SamplingParams(max_tokens=16, **bad)


SHAPED = [
    SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=1, presence_penalty=0.5, logprobs=True),
    SamplingParams(max_tokens=12, temperature=0.9, seed=3, repetition_penalty=1.4, logit_bias={9: 3.0}),
    SamplingParams(max_tokens=12, min_tokens=6, stop_token_ids=[7, 8], top_logprobs=5),
    SamplingParams(max_tokens=12, ignore_eos=True),
]


def _run(engine: Engine, prompts: list[list[int]]):
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SHAPED[i % len(SHAPED)])
    return run_to_end(engine)


@pytest.mark.timeout(120)
def test_shaping_is_the_same_colocated_overlapped_and_disaggregated() -> None:
    prompts = prompts_for_block_size(4, count=12)
    want = _run(tiny_engine(), prompts)
    overlapped = _run(tiny_engine(overlap=True), prompts)
    pd = disaggregated(
        tiny_engine("prefill"),
        tiny_engine("decode"),
        prompts,
        [SHAPED[i % len(SHAPED)] for i in range(len(prompts))],
    )
    for rid, res in want.items():
        assert overlapped[rid].tokens == res.tokens, rid
        assert pd[rid].tokens == res.tokens, rid


@pytest.mark.timeout(60)
def test_top_logprobs_are_sorted_and_hold_the_greedy_token() -> None:
    engine = tiny_engine()
    engine.add_request("g", [3, 1, 4, 1, 5], SamplingParams(max_tokens=6, ignore_eos=True, top_logprobs=20))
    engine.add_request("s", [3, 1, 4], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True))
    tops: dict[str, list] = {"g": [], "s": []}
    tokens: dict[str, list] = {"g": [], "s": []}
    logprobs: dict[str, list] = {"g": [], "s": []}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.logprobs or []
            tops[out.request_id] += out.top_logprobs or []
    assert not tops["s"] and len(logprobs["s"]) == 6  # logprobs alone: no alternatives
    assert len(tops["g"]) == 6
    for token, logprob, alternatives in zip(tokens["g"], logprobs["g"], tops["g"], strict=True):
        assert len(alternatives) == 20
        values = [v for _, v in alternatives]
        assert values == sorted(values, reverse=True)
        assert alternatives[0][0] == token and abs(alternatives[0][1] - logprob) < 1e-6
        assert len({t for t, _ in alternatives}) == 20


def _prompt_logprobs(engine: Engine, prompt: list[int], k: int) -> tuple[list, list]:
    engine.add_request("p", prompt, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=k))
    got = None
    while engine.has_work():
        for out in engine.step():
            if out.prefill is not None:
                got = out.prefill.prompt_logprobs
            elif out.prompt_logprobs is not None:
                assert got is None, "prompt logprobs come once, with the first token"
                got = out.prompt_logprobs
    assert got is not None
    return got.logprobs, got.top


@pytest.mark.timeout(60)
def test_prompt_logprobs_chunked_colocated_and_prefill_alike() -> None:
    prompt = prompts_for_block_size(4, count=6)[5] * 3  # a few blocks long
    whole, whole_top = _prompt_logprobs(tiny_engine(), prompt, 3)
    assert len(whole) == len(prompt) and whole[0] is None and whole_top[0] == []
    assert all(v is not None and v <= 0 for v in whole[1:])
    for top, token, value in zip(whole_top[1:], prompt[1:], whole[1:], strict=True):
        values = [v for _, v in top]
        assert len(top) == 3 and values == sorted(values, reverse=True) and value <= values[0] + 1e-6
        assert token not in [t for t, _ in top] or dict(top)[token] == pytest.approx(value, abs=1e-5)
    for engine in (tiny_engine(max_num_batched_tokens=8, max_num_seqs=4), tiny_engine("prefill")):
        got, got_top = _prompt_logprobs(engine, prompt, 3)
        assert got[0] is None
        torch.testing.assert_close(got[1:], whole[1:], atol=1e-5, rtol=1e-5)
        assert [[t for t, _ in top] for top in got_top] == [[t for t, _ in top] for top in whole_top]


@pytest.mark.timeout(60)
def test_prompt_logprobs_are_computed_for_a_prompt_the_prefix_cache_holds() -> None:
    # a prompt logprob is read off the prefill's logits: a cached block would leave its tokens out
    prompt = prompts_for_block_size(4, count=6)[5] * 3
    whole, whole_top = _prompt_logprobs(tiny_engine(), prompt, 3)
    for engine in (tiny_engine(), tiny_engine("prefill")):
        engine.add_request("warm", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        run_to_end(engine)
        if engine.role == "prefill":
            engine.release("warm")
        assert engine.prefix_cache_stats()["num_cached_blocks"] > 0
        hits_before = engine.prefix_cache_stats()["num_hit_tokens"]
        got, got_top = _prompt_logprobs(engine, prompt, 3)
        assert len(got) == len(prompt) and got[0] is None
        torch.testing.assert_close(got[1:], whole[1:], atol=1e-5, rtol=1e-5)
        assert [[t for t, _ in top] for top in got_top] == [[t for t, _ in top] for top in whole_top]
        assert engine.prefix_cache_stats()["num_hit_tokens"] == hits_before  # every token computed


SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "ok", "n"],
    "additionalProperties": False,
}
FORMAT = json.dumps({"type": "json_schema", "json_schema": {"schema": SCHEMA}})


@pytest.mark.timeout(120)
def test_structured_output_parses_colocated_overlapped_and_disaggregated() -> None:
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    prompts = prompts_for_block_size(4, count=8)
    params = [SamplingParams(max_tokens=48, temperature=1, seed=i, response_format=FORMAT) for i in range(8)]
    params[0] = SamplingParams(max_tokens=48, response_format=FORMAT)  # greedy
    results = []
    for engine in (tiny_engine(), tiny_engine(overlap=True)):
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"r{i}", prompt, p)
        results.append(run_to_end(engine))
    results.append(disaggregated(tiny_engine("prefill"), tiny_engine("decode"), prompts, params))
    for out in results:
        for i in range(len(prompts)):
            res = out[f"r{i}"]
            assert res.finish_reason == "stop" and res.tokens[-1] == 257  # the grammar ends in EOS
            jsonschema.validate(json.loads(bytes(res.tokens[:-1]).decode()), SCHEMA)
        assert [out[f"r{i}"].tokens for i in range(len(prompts))] == [
            results[0][f"r{i}"].tokens for i in range(len(prompts))
        ]


@pytest.mark.timeout(30)
def test_structured_output_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("xgrammar")
    engine = tiny_engine()
    schema = {"type": "object", "minProperties": "x"}
    bad = json.dumps({"type": "json_schema", "json_schema": {"schema": schema}})
    with pytest.raises(InvalidRequest, match="response_format"):
        engine.add_request("bad", [1, 2], SamplingParams(response_format=bad))
    # json_object: the first token can only open an object
    engine.add_request("o", [1, 2], SamplingParams(max_tokens=1, response_format='{"type": "json_object"}'))
    assert run_to_end(engine)["o"].tokens == [ord("{")]
    monkeypatch.setattr(grammar, "available", lambda backend="": False)
    with pytest.raises(InvalidRequest, match=r"needs the xgrammar package.*structured"):
        tiny_engine().add_request("x", [1, 2], SamplingParams(response_format=FORMAT))
