"""SamplingParams validation and the batched sampler (greedy, temperature, top-k, top-p, seeds)."""

from __future__ import annotations

import pickle

import msgspec
import pytest
import torch

from moriio_ray.engine.sampler import SamplingRow, row_key, sample, uniform_noise
from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.errors import InvalidRequest


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 0},
        {"max_tokens": 1.5},
        {"temperature": -0.1},
        {"temperature": "hot"},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"seed": 1.5},
        {"stop": "x"},
        {"stop": [""]},
        {"stop_token_ids": [-1]},
        {"ignore_eos": 1},
        {"logprobs": "yes"},
    ],
)
def test_invalid_params_raise_invalid_request(bad: dict) -> None:
    with pytest.raises(InvalidRequest, match=next(iter(bad))):
        SamplingParams(**bad)
    with pytest.raises((InvalidRequest, msgspec.ValidationError)):
        msgspec.convert(bad, SamplingParams)


@pytest.mark.timeout(10)
def test_params_pickle_and_decode() -> None:
    params = SamplingParams(max_tokens=3, temperature=0.7, top_k=5, seed=9, stop=["\n"], logprobs=True)
    assert pickle.loads(pickle.dumps(params)) == params
    assert msgspec.json.decode(msgspec.json.encode(params), type=SamplingParams) == params
    assert SamplingParams(top_k=0).top_k == 0 and SamplingParams().greedy
    with pytest.raises(msgspec.ValidationError, match="unknown"):
        msgspec.convert({"max_tokens": 2, "bogus": 1}, SamplingParams)


def _row(temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0, seed: int = 0, pos: int = 0):
    return SamplingRow(temperature, top_k, top_p, row_key(seed, pos), False)


@pytest.mark.timeout(10)
def test_greedy_is_argmax_and_topk1_is_greedy() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    tokens, lps = sample(logits, [_row(temperature=0.0)] * 6)
    assert tokens == logits.argmax(-1).tolist() and lps == [None] * 6
    tokens, _ = sample(logits, [_row(temperature=3.0, top_k=1, seed=s) for s in range(6)])
    assert tokens == logits.argmax(-1).tolist()
    tokens, _ = sample(logits, [_row(temperature=3.0, top_p=1e-6, seed=s) for s in range(6)])
    assert tokens == logits.argmax(-1).tolist()


@pytest.mark.timeout(10)
def test_noise_is_a_pure_function_of_key_and_token() -> None:
    keys = [row_key(1, 0), row_key(1, 1), row_key(2, 0)]
    a = uniform_noise(keys, 1000, torch.device("cpu"))
    b = uniform_noise(keys[::-1], 1000, torch.device("cpu"))
    assert torch.equal(a, b.flip(0))
    assert torch.equal(uniform_noise(keys, 300, torch.device("cpu")), a[:, :300])  # prefix-stable
    assert 0.0 < a.min() and a.max() < 1.0 and abs(a.mean().item() - 0.5) < 0.02
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])


@pytest.mark.timeout(20)
def test_sampling_follows_the_distribution_with_filters() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -9.0]])
    probs = logits.softmax(-1)[0]
    n = 4000
    rows = [_row(seed=7, pos=i) for i in range(n)]
    tokens, _ = sample(logits.expand(n, -1).contiguous(), rows)
    freq = torch.bincount(torch.tensor(tokens), minlength=5).float() / n
    assert torch.allclose(freq, probs, atol=0.03), (freq, probs)
    tokens, _ = sample(logits.expand(n, -1).contiguous(), [_row(seed=7, pos=i, top_k=2) for i in range(n)])
    freq = torch.bincount(torch.tensor(tokens), minlength=5).float() / n
    assert freq[2:].sum() == 0 and abs(freq[0].item() - probs[0] / probs[:2].sum()) < 0.03
    # top_p = 0.8: tokens 0 (0.64) and 1 (0.24) make the nucleus; token 2 onwards never appears
    tokens, _ = sample(logits.expand(n, -1).contiguous(), [_row(seed=7, pos=i, top_p=0.8) for i in range(n)])
    assert set(tokens) == {0, 1}


@pytest.mark.timeout(10)
def test_rows_do_not_depend_on_batch_composition() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 100, generator=gen)
    rows = [_row(temperature=1.5, top_k=[-1, 10][i % 2], top_p=[1.0, 0.9][i % 2 == 0], seed=i, pos=3)
            for i in range(8)]  # fmt: skip
    together, _ = sample(logits, rows)
    alone = [sample(logits[i : i + 1], [rows[i]])[0][0] for i in range(8)]
    assert together == alone
    mixed, _ = sample(logits, [_row(temperature=0.0), *rows[1:]])
    assert mixed[0] == logits[0].argmax().item() and mixed[1:] == together[1:]


@pytest.mark.timeout(10)
def test_logprobs_for_requested_rows_only() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(5))
    rows = [
        SamplingRow(0.0, -1, 1.0, 0, True),
        SamplingRow(0.0, -1, 1.0, 0, False),
        SamplingRow(2.0, -1, 1.0, 9, True),
    ]
    tokens, lps = sample(logits, rows)
    ref = logits.log_softmax(-1)
    assert lps[1] is None
    assert lps[0] == pytest.approx(ref[0, tokens[0]].item()) and lps[2] == pytest.approx(
        ref[2, tokens[2]].item()
    )
