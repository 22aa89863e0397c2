"""Stop conditions (max_tokens, max_model_len, stop ids, EOS, stop strings) and logprobs."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import run_to_end, tiny_engine

from moriio_ray.engine.batch import Batch
from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.engine.sequence import Sequence
from tests.integration.reference import truncate_at_stop

PROMPT = [72, 101, 108, 108, 111, 44, 32]  # "Hello, "


def _generate(params: SamplingParams, prompt: list[int] = PROMPT, engine=None):
    engine = engine or tiny_engine()
    engine.add_request("r", prompt, params)
    result = run_to_end(engine)["r"]
    assert engine.stats()["num_used_blocks"] == 0
    return result


@pytest.fixture(scope="module")
def reference() -> list[int]:
    tokens = _generate(SamplingParams(max_tokens=40, ignore_eos=True)).tokens
    assert len(tokens) == 40
    return tokens


@pytest.mark.timeout(30)
def test_max_tokens_and_max_model_len(reference: list[int]) -> None:
    res = _generate(SamplingParams(max_tokens=7, ignore_eos=True))
    assert res.tokens == reference[:7] and res.finish_reason == "length"
    engine = tiny_engine(max_model_len=12)
    res = _generate(SamplingParams(max_tokens=30, ignore_eos=True), engine=engine)
    assert res.tokens == reference[:5] and res.finish_reason == "length"  # 7 + 5 == 12


@pytest.mark.timeout(30)
def test_stop_token_ids_and_eos(reference: list[int]) -> None:
    k = next(i for i in range(3, 40) if reference[i] not in reference[:i])
    res = _generate(SamplingParams(max_tokens=40, stop_token_ids=[reference[k]]))
    assert res.tokens == reference[: k + 1] and res.finish_reason == "stop"

    engine = tiny_engine()
    engine.tokenizer.eos_token_ids = [reference[k]]
    res = _generate(SamplingParams(max_tokens=40), engine=engine)
    assert res.tokens == reference[: k + 1] and res.finish_reason == "stop"
    res = _generate(SamplingParams(max_tokens=40, ignore_eos=True), engine=engine)
    assert res.tokens == reference and res.finish_reason == "length"


@pytest.mark.timeout(30)
def test_stop_strings(reference: list[int]) -> None:
    # a two-token stop string: two ASCII bytes in a row, not seen earlier in the output
    ascii_pairs = [i for i in range(2, 39) if reference[i] < 128 and reference[i + 1] < 128]
    k = next(i for i in ascii_pairs if bytes(reference[i : i + 2]) not in bytes(reference[: i + 1]))
    stop = bytes(reference[k : k + 2]).decode("ascii")
    engine = tiny_engine()
    params = SamplingParams(max_tokens=40, stop=["never-there", stop])
    res = _generate(params, engine=engine)
    assert res.finish_reason == "stop"
    assert res.tokens == reference[: k + 2]
    text = truncate_at_stop(engine.tokenizer.decode(res.tokens), params.stop)
    assert text == engine.tokenizer.decode(reference[:k]) and stop not in text
    assert engine.tokenizer.decode(res.tokens).endswith(stop)


@pytest.mark.timeout(30)
def test_logprobs_are_the_raw_log_softmax(reference: list[int]) -> None:
    engine = tiny_engine()
    res = _generate(SamplingParams(max_tokens=5, ignore_eos=True, logprobs=True), engine=engine)
    assert len(res.logprobs) == 5 and all(lp <= 0.0 for lp in res.logprobs)
    seq = Sequence("x", PROMPT, SamplingParams(), seed=0)
    seq.block_table = engine.allocator.allocate(2)
    logits = engine.runner.run(Batch.prefill([seq]))
    expected = logits.log_softmax(-1)[0, reference[0]].item()
    assert res.logprobs[0] == pytest.approx(expected, abs=1e-5)
    # a sampled (non-argmax) token reports its own, lower, log probability
    hot = _generate(SamplingParams(max_tokens=20, temperature=5.0, seed=3, ignore_eos=True, logprobs=True))
    assert min(hot.logprobs) < max(res.logprobs) - 1.0
    assert _generate(SamplingParams(max_tokens=3, ignore_eos=True)).logprobs == []


@pytest.mark.timeout(30)
def test_seeded_sampling_reproduces_and_seeds_differ() -> None:
    def sample(seed: int | None) -> list[int]:
        return _generate(SamplingParams(max_tokens=16, temperature=2.0, top_p=0.95, seed=seed)).tokens

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)
    assert sample(None) != sample(None)  # fresh random seeds (a collision has probability ~1e-30)
    torch.manual_seed(0)  # the global torch RNG plays no part
    a = sample(11)
    torch.manual_seed(1)
    assert sample(11) == a
