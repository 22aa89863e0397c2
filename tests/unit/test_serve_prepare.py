"""Request -> (prompt token ids, SamplingParams), with the byte tokenizer of the tiny preset.

Errors go through what the ingress does before any pipeline work: ``prepare_*`` (parsing, the
OpenAI request's own rules), then the pipeline's one check against the model
(``caller/validate.py``, which ``PDPipeline.make_request`` runs), mapped to the request's fields.
"""

from __future__ import annotations

import json

import pytest

from moriio_ray.caller.validate import check_request
from moriio_ray.engine.tokenizer import ByteTokenizer
from moriio_ray.serve.errors import APIError, from_exception
from moriio_ray.serve.openai import ChatCompletionRequest, CompletionRequest, parse_request
from moriio_ray.serve.prepare import Limits, Prepared, prepare_chat, prepare_completion

LIMITS = Limits(model_name="tiny", max_model_len=64, default_max_tokens=16)
TOK = ByteTokenizer()


def _completion(**body: object) -> Prepared:
    prompts = _completions(**body)
    assert len(prompts) == 1
    return prompts[0]


def _completions(**body: object) -> list[Prepared]:
    req = parse_request(json.dumps({"prompt": "hello", **body}).encode(), CompletionRequest)
    return prepare_completion(req, TOK, LIMITS)


def _chat(**body: object) -> Prepared:
    base = {"messages": [{"role": "user", "content": "hi"}]}
    req = parse_request(json.dumps({**base, **body}).encode(), ChatCompletionRequest)
    return prepare_chat(req, TOK, LIMITS)


def _ingress(fn: object, **body: object) -> list[Prepared]:
    got: Prepared | list[Prepared] = fn(**body)  # type: ignore[operator]
    prompts = got if isinstance(got, list) else [got]
    for prepared in prompts:
        try:
            check_request(
                prepared.token_ids,
                prepared.params,
                vocab_size=TOK.vocab_size,
                max_model_len=LIMITS.max_model_len,
            )
        except Exception as exc:
            raise from_exception(exc, validating=True, fields=prepared.fields) from None
    return prompts


def _error(fn: object, **body: object) -> APIError:
    with pytest.raises(APIError) as info:
        _ingress(fn, **body)
    return info.value


@pytest.mark.timeout(10)
def test_string_and_token_prompts() -> None:
    assert _completion().token_ids == list(b"hello")
    assert _completion(prompt=[104, 105]).token_ids == [104, 105]
    assert _completion(prompt=["hi"]).token_ids == list(b"hi")
    assert _completion(prompt=[[1, 2, 3]]).token_ids == [1, 2, 3]


@pytest.mark.timeout(10)
def test_sampling_fields_reach_the_params() -> None:
    p = _completion(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=11, stop=["a", "b"], stop_token_ids=[5]
    ).params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0.5, 0.9, 3, 11)
    assert p.stop == ["a", "b"] and p.stop_token_ids == [5] and not p.ignore_eos and not p.logprobs
    assert _completion(logprobs=0).params.logprobs
    assert _completion(ignore_eos=True).params.ignore_eos


@pytest.mark.timeout(10)
def test_defaults() -> None:
    p = _completion().params
    assert p.max_tokens == 16 and p.temperature == 1.0 and p.top_k == -1
    # the default is cut to the room left after the prompt
    assert _completion(prompt="x" * 60).params.max_tokens == 4


@pytest.mark.timeout(10)
def test_chat_template_and_max_completion_tokens() -> None:
    prepared = _chat(max_completion_tokens=5)
    assert bytes(prepared.token_ids).decode() == "user: hi\nassistant:"
    assert prepared.params.max_tokens == 5
    assert _chat(max_tokens=6).params.max_tokens == 6
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert (
        bytes(_chat(messages=[{"role": "user", "content": parts}]).token_ids)
        .decode()
        .startswith("user: a\nb")
    )


@pytest.mark.timeout(10)
@pytest.mark.parametrize("value", [0, -3])
def test_max_tokens_must_be_positive(value: int) -> None:
    err = _error(_completion, max_tokens=value)
    assert err.status == 400 and err.info.param == "max_tokens"
    err = _error(_chat, max_completion_tokens=value)
    assert err.status == 400 and err.info.param == "max_completion_tokens"


@pytest.mark.timeout(10)
def test_too_long_prompt_is_400_context_length_exceeded() -> None:
    err = _error(_completion, prompt="x" * 64)
    assert (err.status, err.info.code, err.info.param) == (400, "context_length_exceeded", "prompt")
    err = _error(_completion, prompt="x" * 60, max_tokens=5)
    assert (err.status, err.info.code, err.info.param) == (400, "context_length_exceeded", "max_tokens")
    assert "at most 4" in err.info.message
    err = _error(_chat, messages=[{"role": "user", "content": "y" * 80}])
    assert (err.status, err.info.param) == (400, "messages")


@pytest.mark.timeout(10)
def test_unknown_model_is_404() -> None:
    err = _error(_completion, model="gpt-4")
    assert (err.status, err.info.code, err.info.param) == (404, "model_not_found", "model")
    assert _completion(model="tiny").token_ids


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("fn", "body", "param"),
    [
        (_completion, {"n": 0}, "n"),
        (_completion, {"n": 17}, "n"),
        (_completions, {"prompt": ["a", 3]}, "prompt"),
        (_completions, {"prompt": [[1], []]}, "prompt"),
        (_completions, {"prompt": ["a"] * 65}, "prompt"),
        (_completions, {"prompt": ["a"] * 16, "n": 9}, "prompt"),
        (_completion, {"prompt": []}, "prompt"),
        (_completion, {"prompt": ""}, "prompt"),
        (_completion, {"prompt": [1, 999]}, "prompt"),
        (_completion, {"prompt": [1, "a"]}, "prompt"),
        (_completion, {"logprobs": 21}, "logprobs"),
        (_completion, {"logprobs": -1}, "logprobs"),
        (_completion, {"echo": True, "max_tokens": 0, "min_tokens": 2, "logprobs": 1}, "min_tokens"),
        (_completion, {"presence_penalty": 2.5}, "presence_penalty"),
        (_completion, {"frequency_penalty": -2.5}, "frequency_penalty"),
        (_completion, {"logit_bias": {"x": 1}}, "logit_bias"),
        (_completion, {"logit_bias": {"5": 200}}, "logit_bias"),
        (_completion, {"logit_bias": {"999": 1}}, "logit_bias"),
        (_completion, {"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        (_completion, {"repetition_penalty": 0}, "repetition_penalty"),
        (_chat, {"response_format": {"type": "xml"}}, "response_format.type"),
        (_chat, {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        (_completion, {"temperature": -1}, "temperature"),
        (_completion, {"top_p": 0}, "top_p"),
        (_completion, {"top_k": -5}, "top_k"),
        (_completion, {"stop": [""]}, "stop"),
        (_chat, {"messages": []}, "messages"),
        (_chat, {"messages": [{"role": "wizard", "content": "a"}]}, "messages[0].role"),
        (
            _chat,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
        ),
        (_chat, {"max_tokens": 2, "max_completion_tokens": 2}, "max_completion_tokens"),
        (_chat, {"top_logprobs": 3}, "top_logprobs"),
    ],
)
def test_bad_values_are_400_naming_the_field(fn: object, body: dict, param: str) -> None:
    err = _error(fn, **body)
    assert err.status == 400 and err.info.param == param, err.info


@pytest.mark.timeout(10)
def test_the_check_against_the_model_is_the_pipelines_alone() -> None:
    # prepare parses and tokenizes; the empty prompt, token ids and length rule are checked once,
    # in PDPipeline.make_request (caller/validate.py), not here again
    assert prepare_completion(parse_request(b'{"prompt": [1, 999]}', CompletionRequest), TOK, LIMITS)[
        0
    ].token_ids == [
        1,
        999,
    ]
    assert _completion(prompt="x" * 64).params.max_tokens == 1  # no room: make_request's 400
    assert _error(_completion, prompt=[1, 999]).info.param == "prompt"
