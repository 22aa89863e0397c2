"""The bounds on every SamplingParams field (issue: one top_k past int64 killed a prefill engine)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from moriio_ray.engine import sampling
from moriio_ray.engine.sampler import SamplingRow, row_key, sample, sample_each
from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.errors import InvalidRequest

BAD: list[tuple[dict[str, Any], str]] = [
    ({"top_k": 2**63, "temperature": 1.0}, "top_k"),  # the value that killed the engine
    ({"top_k": 2**64}, "top_k"),
    ({"top_k": 10**30}, "top_k"),
    ({"top_k": sampling.MAX_VOCAB_SIZE + 1}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"top_k": False}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"max_tokens": sampling.MAX_TOKENS_CAP + 1}, "max_tokens"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": 10**400}, "temperature"),  # an int past float's range
    ({"top_p": math.nan}, "top_p"),
    ({"top_p": -math.inf}, "top_p"),
    ({"stop": ["s"] * (sampling.MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": ["x" * (sampling.MAX_STOP_BYTES + 1)]}, "stop[0]"),
    ({"stop": ["ok", "é" * (sampling.MAX_STOP_BYTES // 2 + 1)]}, "stop[1]"),  # bytes, not chars
    ({"stop_token_ids": [1] * (sampling.MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ({"stop_token_ids": [1, 2**63]}, "stop_token_ids[1]"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("kwargs", "field"), BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_out_of_range_values_name_their_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith(f"{field}: "), message
    assert len(message) < 200  # a huge value is not echoed whole


@pytest.mark.timeout(10)
def test_the_edges_are_accepted() -> None:
    SamplingParams(top_k=sampling.MAX_VOCAB_SIZE, temperature=1.0)
    SamplingParams(seed=2**64 - 1)
    SamplingParams(seed=-(2**63))
    SamplingParams(max_tokens=sampling.MAX_TOKENS_CAP, temperature=sampling.MAX_TEMPERATURE)
    SamplingParams(stop=["x" * sampling.MAX_STOP_BYTES] * sampling.MAX_STOP_STRINGS)
    SamplingParams(stop_token_ids=[sampling.MAX_VOCAB_SIZE - 1] * sampling.MAX_STOP_TOKEN_IDS)


@pytest.mark.timeout(10)
def test_the_models_vocabulary_bounds() -> None:
    SamplingParams(top_k=260, stop_token_ids=[259]).check_for_model(260)
    with pytest.raises(InvalidRequest, match=r"^top_k: 261 must be at most the vocabulary size 260"):
        SamplingParams(top_k=261).check_for_model(260)
    with pytest.raises(InvalidRequest, match=r"^stop_token_ids\[0\]: 260 is not a token id"):
        SamplingParams(stop_token_ids=[260]).check_for_model(260)


@pytest.mark.timeout(10)
def test_the_sampler_takes_any_top_k_and_a_tiny_temperature() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    # a top_k past the vocabulary (or past int64, if one got here) is the whole vocabulary
    rows = [SamplingRow(1.0, k, 1.0, row_key(5, 0), False) for k in (50, 2**24, 2**70)]
    tokens, _ = sample(logits[[0, 0, 0]], rows)
    assert len(set(tokens)) == 1
    # a positive temperature too small to divide by is greedy, not NaN
    tiny = [SamplingRow(1e-30, -1, 1.0, row_key(1, 0), True) for _ in range(3)]
    tokens, logprobs = sample(logits, tiny)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert all(lp is not None and math.isfinite(lp) for lp in logprobs)


@pytest.mark.timeout(10)
def test_sample_each_matches_sample_row_by_row() -> None:
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(1))
    rows = [
        SamplingRow(0.0, -1, 1.0, 0, True),
        SamplingRow(0.8, 5, 1.0, row_key(2, 3), False),
        SamplingRow(1.3, -1, 0.7, row_key(9, 1), True),
        SamplingRow(1.0, 3, 0.9, row_key(4, 0), False),
    ]
    tokens, logprobs, errors = sample_each(logits, rows)
    assert (tokens, logprobs) == sample(logits, rows) and errors == [None] * 4
    for i, row in enumerate(rows):  # a row's token does not depend on the batch around it
        assert sample(logits[i : i + 1], [row])[0] == [tokens[i]]
