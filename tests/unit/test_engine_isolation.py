"""Fault isolation in the engine: a fault that one request causes ends that request alone.

The failures are injected into one request of a running batch (its stop rule, its sampling); the
other requests must finish with exactly the tokens they get in a clean run, and every block must
come back. A fault outside the per-request parts (the model's forward) still fails the step.
"""

from __future__ import annotations

from typing import Any

import pytest
from engine_helpers import Result, run_to_end, tiny_engine

from moriio_ray.engine import sampler
from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.errors import InvalidRequest

PROMPTS = [[72, 101, 108, 108, 111], [87, 111, 114, 108, 100, 33, 32], [1, 2, 3], [200, 100, 50, 25]]
GOOD = SamplingParams(max_tokens=12, ignore_eos=True)


def _clean_tokens() -> dict[str, list[int]]:
    engine = tiny_engine()
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GOOD)
    return {rid: res.tokens for rid, res in run_to_end(engine).items()}


def _run_with_errors(engine: Any) -> tuple[dict[str, Result], dict[str, tuple[str, str]]]:
    """Step to the end; the outputs per request, and the error each failed request ended with."""
    results: dict[str, Result] = {}
    errors: dict[str, tuple[str, str]] = {}
    while engine.has_work():
        for out in engine.step():
            res = results.setdefault(out.request_id, Result())
            assert not res.finished, f"{out.request_id} produced output after finishing"
            res.tokens += out.new_token_ids
            res.finished, res.finish_reason = out.finished, out.finish_reason
            if out.error is not None:
                assert out.finished and not out.new_token_ids
                errors[out.request_id] = out.error
    return results, errors


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [False, True])
def test_a_failing_stop_rule_ends_only_its_request(monkeypatch: pytest.MonkeyPatch, overlap: bool) -> None:
    clean = _clean_tokens()
    engine = tiny_engine(overlap=overlap)
    real_decode = engine.tokenizer.decode

    def decode(ids: list[int]) -> str:
        # only the request with a stop string decodes its tail in the stop check; fail its 4th
        if len(ids) >= 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real_decode(ids)

    monkeypatch.setattr(engine.tokenizer, "decode", decode)
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=12, ignore_eos=True, stop=["never-there"]) if i == 1 else GOOD
        engine.add_request(f"r{i}", prompt, params)
    results, errors = _run_with_errors(engine)
    assert set(errors) == {"r1"}
    kind, message = errors["r1"]
    assert kind == "RequestFailed" and "r1" in message and "UnicodeDecodeError" in message
    assert results["r1"].tokens == clean["r1"][:3]  # the tokens before the fault came out
    for rid in ("r0", "r2", "r3"):
        assert results[rid].tokens == clean[rid] and results[rid].finish_reason == "length"
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_running"] == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [False, True])
def test_a_failing_sampler_row_ends_only_its_request(monkeypatch: pytest.MonkeyPatch, overlap: bool) -> None:
    clean = _clean_tokens()
    real_filter = sampler._filter

    def failing_filter(scaled: Any, rows: list[sampler.SamplingRow]) -> Any:
        if any(r.top_p == 0.25 for r in rows):
            raise ValueError("Overflow when unpacking long long (injected)")
        return real_filter(scaled, rows)

    monkeypatch.setattr(sampler, "_filter", failing_filter)
    engine = tiny_engine(overlap=overlap)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GOOD)
    # joins the running batch after the others have decoded a few tokens
    for _ in range(3):
        engine.step()
    engine.add_request("bad", [5, 6, 7], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.25, seed=3))
    results, errors = _run_with_errors(engine)
    assert set(errors) == {"bad"} and errors["bad"][0] == "RequestFailed"
    for rid in ("r0", "r1", "r2", "r3"):
        assert clean[rid][-len(results[rid].tokens) :] == results[rid].tokens
        assert results[rid].finish_reason == "length"
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    # the engine still serves a new request, with the clean tokens
    engine.add_request("again", PROMPTS[0], GOOD)
    assert run_to_end(engine)["again"].tokens == clean["r0"]


@pytest.mark.timeout(60)
def test_a_prefill_engine_reports_a_failing_first_token() -> None:
    engine = tiny_engine("prefill")
    real_filter = sampler._filter

    def failing_filter(scaled: Any, rows: list[sampler.SamplingRow]) -> Any:
        if any(r.top_k == 7 for r in rows):
            raise IndexError("injected")
        return real_filter(scaled, rows)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampler, "_filter", failing_filter)
        engine.add_request("ok", PROMPTS[0], SamplingParams(max_tokens=4, temperature=1.0, top_k=3, seed=1))
        engine.add_request("bad", PROMPTS[1], SamplingParams(max_tokens=4, temperature=1.0, top_k=7, seed=1))
        results, errors = _run_with_errors(engine)
    assert set(errors) == {"bad"}
    assert results["ok"].finished and len(results["ok"].tokens) == 1
    stats = engine.stats()
    # the good request's prompt is leased for D; the failed one holds nothing
    assert stats["num_leased_blocks"] == stats["num_used_blocks"] == 2
    assert engine.release("ok") and engine.stats()["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.timeout(30)
def test_a_fault_in_the_forward_still_fails_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_engine()
    engine.add_request("r", PROMPTS[0], GOOD)

    def broken(*args: Any) -> Any:
        raise RuntimeError("device lost (injected)")

    monkeypatch.setattr(engine.runner, "run", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()


@pytest.mark.timeout(30)
def test_the_engine_checks_the_vocabulary_bounds() -> None:
    engine = tiny_engine()
    vocab = engine.args.vocab_size
    with pytest.raises(InvalidRequest, match=r"^top_k: .* vocabulary"):
        engine.add_request("r", [1, 2], SamplingParams(top_k=vocab + 1, temperature=1.0))
    with pytest.raises(InvalidRequest, match=r"^stop_token_ids\[1\]"):
        engine.add_request("r", [1, 2], SamplingParams(stop_token_ids=[1, vocab]))
    engine.add_request("r", [1, 2], SamplingParams(top_k=vocab, temperature=1.0, seed=0, max_tokens=3))
    assert len(run_to_end(engine)["r"].tokens) == 3
