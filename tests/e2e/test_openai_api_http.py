"""The OpenAI API that real clients send, through the official ``openai`` client and raw HTTP, to the
session's ``serve run configs/tiny_1p1d_cpu.yaml`` (1 prefill + 1 decode engine: every request takes
the disaggregated path, P sampling the first token and D the rest, so the sampling params travel).

Each feature changes the output the way its definition says: penalties cut the repetition of a
greedy repetitive prompt, ``logit_bias`` moves the greedy first token, ``min_tokens`` holds a stop
token back, ``n`` samples differ, the alternatives are sorted with the greedy token's on top.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from bench.launch import ServeProcess
from moriio_ray.serve.handler import IGNORED_HEADER
from tests.e2e.serving import Shared

MODEL = "tiny"
TIMEOUT_S = 300  # the first test may start the shared server (tens of seconds on 2 busy cores)
REPEAT = "abcabcabcabcabcabc"


@pytest.fixture(scope="module")
def server(tiny_serve: Shared) -> ServeProcess:
    return tiny_serve.get()


def _tokens(client: openai.OpenAI, prompt: str | list[int], max_tokens: int = 24, **kw: Any) -> list[str]:
    """The greedy completion's tokens (as text), EOS ignored."""
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0, extra_body=extra, **kw
    )
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    return logprobs.tokens


def _token_id(http: httpx.Client, text: str) -> int:
    resp = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert resp.status_code == 200, resp.text
    ids = resp.json()["tokens"]
    assert len(ids) == 1, ids
    return int(ids[0])


# Token-id prompts; the tiny model's greedy output repeats after some of them (the test takes the first).
REPETITIVE: list[list[int]] = [[5, 6, 7] * 3, [1, 2, 3, 4] * 3, [40] * 8, [97, 98] * 6, [10, 20, 30] * 4]


@pytest.mark.timeout(TIMEOUT_S)
def test_penalties_cut_repetition(client: openai.OpenAI) -> None:
    outputs = [_tokens(client, prompt) for prompt in REPETITIVE]
    pairs = zip(REPETITIVE, outputs, strict=True)
    repeating = [(p, out) for p, out in pairs if len(set(out)) <= len(out) // 3]
    assert repeating, f"no greedy output repeats: {outputs}"
    prompt, plain = repeating[0]
    for kw in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 4.0}},
    ):
        penalized = _tokens(client, prompt, **kw)
        assert len(set(penalized)) > len(set(plain)), (kw, plain, penalized)


@pytest.mark.timeout(TIMEOUT_S)
def test_logit_bias_and_min_tokens(client: openai.OpenAI, http: httpx.Client) -> None:
    first = _tokens(client, REPEAT, max_tokens=4)
    banned = _token_id(http, first[0])
    moved = _tokens(client, REPEAT, max_tokens=4, logit_bias={str(banned): -100})
    assert moved[0] != first[0]
    forced = _token_id(http, "z")
    assert _tokens(client, REPEAT, max_tokens=5, logit_bias={str(forced): 100}) == ["z"] * 5
    # a stop token that greedy decoding picks first: held back until min_tokens tokens are out
    stop = {"stop_token_ids": [banned], "ignore_eos": False}
    out = client.completions.create(model=MODEL, prompt=REPEAT, max_tokens=12, temperature=0, extra_body=stop)
    assert (
        out.choices[0].finish_reason == "stop" and out.usage is not None and out.usage.completion_tokens == 1
    )
    out = client.completions.create(
        model=MODEL, prompt=REPEAT, max_tokens=12, temperature=0, extra_body={**stop, "min_tokens": 5}
    )
    assert out.usage is not None and out.usage.completion_tokens >= 6  # the stop id may come 6th


def _hits(http: httpx.Client, role: str) -> int:
    workers = http.get("/stats").json()["workers"].values()
    return sum(w["prefix_cache"]["num_hit_tokens"] for w in workers if w["role"] == role)


@pytest.mark.timeout(TIMEOUT_S)
def test_n_choices_share_one_prefill(client: openai.OpenAI, http: httpx.Client) -> None:
    # a prompt no other test sends: 3 full blocks of 16 and 5 tokens; its first choice prefills it,
    # the other 3 find its full blocks in P's prefix cache (and D's, which reads only the tail)
    prompt = [200 + (7 * i) % 50 for i in range(53)]
    before = _hits(http, "prefill"), _hits(http, "decode")
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=1.0, n=4, seed=3)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage is not None and out.usage.prompt_tokens == 53
    after = _hits(http, "prefill"), _hits(http, "decode")
    assert after[0] - before[0] >= 3 * 48, (before, after)  # each later choice: 3 blocks found on P
    assert after[1] - before[1] >= 3 * 48, (before, after)  # and on D


@pytest.mark.timeout(TIMEOUT_S)
def test_n_samples_differ_in_one_reply(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=1.0, n=4, seed=7)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert len({c.text for c in out.choices}) >= 3, [c.text for c in out.choices]
    again = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=12, temperature=1.0, n=4, seed=7
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        temperature=1.0,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    finished: set[int] = set()
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finished.add(choice.index)
        usage = chunk.usage or usage
    assert set(texts) == finished == {0, 1, 2}
    assert usage is not None and usage.completion_tokens == 3 * 8


@pytest.mark.timeout(TIMEOUT_S)
def test_top_logprobs_sorted_with_the_greedy_token_on_top(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": REPEAT}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=20,
    )
    content = out.choices[0].logprobs
    assert content is not None and content.content is not None and len(content.content) == 6
    for token in content.content:
        values = [alt.logprob for alt in token.top_logprobs]
        assert len(values) == 20 and values == sorted(values, reverse=True)
        assert token.top_logprobs[0].token == token.token
        assert abs(token.top_logprobs[0].logprob - token.logprob) < 1e-5
    completion = client.completions.create(
        model=MODEL, prompt=REPEAT, max_tokens=4, temperature=0, logprobs=5
    )
    lp = completion.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None and lp.token_logprobs is not None
    for token, value, top in zip(lp.tokens or [], lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 5 <= len(top) <= 6 and abs(max(top.values()) - value) < 1e-5 and top[token] == value


@pytest.mark.timeout(TIMEOUT_S)
def test_echo_prompt_lists_and_field_policy(client: openai.OpenAI, http: httpx.Client) -> None:
    out = client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=0, echo=True)
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [
        (0, "one", "length"),
        (1, "two", "length"),
    ]
    out = client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3] and out.choices[0].text == out.choices[1].text
    ignored = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        user="u",
        store=False,
        metadata={"a": "b"},
        service_tier="auto",
        parallel_tool_calls=True,
        extra_body={"some_new_field": 1},
    )
    assert ignored.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            tools=[{"type": "function", "function": {"name": "f"}}],
        )
    assert info.value.body is not None and info.value.body["param"] == "tools"  # type: ignore[index]
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2, "zeta": 1})
    assert resp.status_code == 200 and resp.headers[IGNORED_HEADER] == "zeta"
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "kv_transfer_params": {}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "kv_transfer_params"
    assert http.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Berlin", "Rome"]},
        "sunny": {"type": "boolean"},
        "degrees": {"type": "integer", "minimum": -20, "maximum": 45},
    },
    "required": ["city", "sunny", "degrees"],
    "additionalProperties": False,
}


@pytest.mark.timeout(TIMEOUT_S)
def test_json_schema_replies_parse_and_validate(client: openai.OpenAI) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    valid = 0
    for i in range(20):
        out = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Weather report number {i}, as JSON."}],
            max_tokens=48,
            temperature=1.0,
            seed=i,
            response_format=fmt,  # type: ignore[arg-type]
        )
        text = out.choices[0].message.content or ""
        jsonschema.validate(json.loads(text), SCHEMA)
        valid += out.choices[0].finish_reason == "stop"
    assert valid == 20
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x"}},  # type: ignore[typeddict-item]
        )
    assert info.value.body is not None and info.value.body["param"] == "response_format.json_schema"  # type: ignore[index]


@pytest.mark.timeout(TIMEOUT_S)
def test_echo_with_prompt_logprobs(client: openai.OpenAI) -> None:
    prompt = "Hello there"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text == prompt and lp is not None and lp.token_logprobs is not None and lp.top_logprobs
    assert lp.tokens == list(prompt) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    extra = {"ignore_eos": True}
    more = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=2, temperature=0, extra_body=extra
    )
    lp2 = more.choices[0].logprobs
    assert lp2 is not None and lp2.token_logprobs is not None
    assert more.choices[0].text.startswith(prompt) and len(lp2.token_logprobs) == len(prompt) + 3
    assert lp2.token_logprobs[0] is None  # the same prompt logprobs as without a completion
    assert lp2.token_logprobs[1 : len(prompt)] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
