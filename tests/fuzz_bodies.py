"""Hypothesis strategies for hostile OpenAI request bodies, and the checks every answer must pass.

A body is mostly plausible (so that many requests reach the engine) with wild values mixed in:
integers past int64, huge and tiny floats, wrong types, deep nesting, unknown and transfer fields,
NaN literals, broken UTF-8 and truncated JSON. Shared by the in-process fuzz (tests/unit) and the
one over real HTTP (tests/e2e).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

EDGE_INTS = [0, -1, 1, 2, 255, 256, 259, 260, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]
EDGE_INTS += [-(2**63), -(2**63) - 1, -(10**30)]
EDGE_FLOATS = [0.0, -0.0, 1e-300, 5e-324, 1e-5, 0.5, 1.0, 1.0000001, 2.0, 1e4, 1e4 + 1, 1e308, -1.0]

_scalar = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(EDGE_INTS)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
wild = st.recursive(
    _scalar,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
_edge_ints = st.sampled_from(EDGE_INTS)
ints = st.one_of(_edge_ints, _edge_ints, st.integers(-3, 300), st.integers())
floats = st.sampled_from(EDGE_FLOATS) | st.floats(-10, 1e5, allow_nan=False) | st.integers(-2, 3)
token_ids = st.lists(ints, max_size=24)

# (valid, hostile) per field: a body is valid fields with at most a couple of hostile ones mixed in
COMMON: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "model": (st.just("tiny"), st.text(max_size=8) | wild),
    "max_tokens": (st.integers(1, 8), ints | wild),
    "temperature": (st.sampled_from([0.0, 0.5, 1.0, 1.5]), floats | wild),
    "top_p": (st.sampled_from([1.0, 0.9, 0.5, 1e-3]), floats | wild),
    "top_k": (st.sampled_from([-1, 0, 1, 5, 260]), ints | wild),
    "seed": (st.integers(0, 2**64 - 1) | st.integers(-(2**63), 0), ints | wild),
    "n": (st.integers(1, 3), ints | wild),
    "stream": (st.booleans(), wild),
    "stream_options": (st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}), wild),
    "stop": (st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=4), max_size=3), wild),
    "stop_token_ids": (st.lists(st.integers(0, 259), max_size=4), token_ids | wild),
    "ignore_eos": (st.booleans(), wild),
    "user": (st.text(max_size=8), wild),
    "presence_penalty": (st.sampled_from([0.0, 0.5, -1.5]), floats | wild),
    "frequency_penalty": (st.sampled_from([0.0, 1.0, 2.0]), floats | wild),
    "repetition_penalty": (st.sampled_from([1.0, 1.3]), floats | wild),
    "min_tokens": (st.integers(0, 1), ints | wild),
    "logit_bias": (st.dictionaries(st.integers(0, 259).map(str), st.floats(-100, 100), max_size=3), wild),
}
EXTRA_KEYS = st.sampled_from(
    ["mood", "kv_transfer_params", "remote_host", "kv_x", "best_of", "suffix", "tools", ""]
)

prompts = (
    st.text(min_size=1, max_size=60) | st.lists(st.integers(0, 259), min_size=1, max_size=24),
    st.one_of(
        st.text(alphabet="ab", min_size=200, max_size=600),  # near or past a short model length
        token_ids,
        st.lists(st.integers(0, 259), min_size=1, max_size=8).map(lambda ids: [ids]),
        st.lists(st.text(max_size=4), min_size=1, max_size=3),
        wild,
    ),
)
_part = st.fixed_dictionaries({"type": st.just("text")}, optional={"text": st.text(max_size=10)})
_valid_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer"])},
    optional={"content": st.text(max_size=40) | st.none() | st.lists(_part, max_size=3)},
)
_hostile_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["tool", "", "USER"]) | wild},
    optional={
        "content": wild | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["image_url", ""])})),
        "name": wild,
    },
)
messages = (
    st.lists(_valid_message, min_size=1, max_size=4),
    st.lists(_valid_message | _hostile_message, max_size=4) | wild,
)


def _body(required: dict[str, tuple[Any, Any]], extra: dict[str, tuple[Any, Any]]) -> Any:
    fields = {**COMMON, **extra}
    names = sorted(fields)

    @st.composite
    def body(draw: Any) -> dict[str, Any]:
        out = {k: draw(valid) for k, (valid, _) in required.items()}
        for name in draw(st.lists(st.sampled_from(names), max_size=4, unique=True)):
            out[name] = draw(fields[name][0])
        num_hostile = draw(st.sampled_from([0, 0, 0, 1, 1, 2]))  # about half the bodies are valid
        hostile = draw(
            st.lists(
                st.sampled_from(sorted({*names, *required})),
                min_size=num_hostile,
                max_size=num_hostile,
                unique=True,
            )
        )
        for name in hostile:
            out[name] = draw({**fields, **required}[name][1])
        if num_hostile and draw(st.integers(0, 4)) == 0:
            out[draw(EXTRA_KEYS)] = draw(wild)
        return out

    return body()


completion_bodies = _body(
    {"prompt": prompts},
    {
        "logprobs": (st.sampled_from([0, 2, None]), st.sampled_from([21, -1]) | wild),
        "echo": (st.booleans(), wild),
    },
)
chat_bodies = _body(
    {"messages": messages},
    {
        "max_completion_tokens": (st.integers(1, 8), ints | wild),
        "logprobs": (st.booleans(), wild),
        "top_logprobs": (st.sampled_from([0, None]), ints | wild),
    },
)


def encoded(bodies: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """Bodies as bytes: JSON (NaN literals allowed), sometimes truncated, broken or deeply nested."""
    as_json = bodies.map(lambda b: json.dumps(b, allow_nan=True).encode())
    broken = st.tuples(as_json, st.integers(0, 200), st.binary(max_size=8)).map(lambda t: t[0][: t[1]] + t[2])
    deep = st.integers(100, 3000).map(lambda d: b'{"prompt": "a", "stop": ' + b"[" * d + b"]" * d + b"}")
    return st.one_of(*[as_json] * 6, broken, deep, st.binary(max_size=40))


def check_error_body(status: int, body: Any) -> None:
    """A 4xx answer is OpenAI-shaped; no answer is a 5xx."""
    assert status < 500, (status, body)
    if status != 200:
        assert isinstance(body, dict) and set(body) == {"error"}, body
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"], error
        assert error["type"] in ("invalid_request_error", "rate_limit_error"), error
        assert error["param"] is None or isinstance(error["param"], str), error
        assert "Traceback" not in error["message"] and "\x1b" not in error["message"], error
