"""Request parsing: JSON bytes -> validated Structs, and the 400s for everything else."""

from __future__ import annotations

import json

import pytest

from moriio_ray.serve.errors import APIError
from moriio_ray.serve.openai import ChatCompletionRequest, CompletionRequest, parse_request


def _parse(body: object, type_: type = CompletionRequest) -> object:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(raw, type_)


def _error(body: object, type_: type = CompletionRequest) -> APIError:
    with pytest.raises(APIError) as info:
        _parse(body, type_)
    return info.value


@pytest.mark.timeout(10)
def test_completion_fields_parse() -> None:
    req = _parse(
        {
            "model": "tiny",
            "prompt": "hi",
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "stream": True,
            "stream_options": {"include_usage": True},
            "stop": "x",
            "seed": 3,
            "logprobs": 0,
            "user": "u",
            "top_k": 4,
            "stop_token_ids": [1],
            "ignore_eos": True,
        }
    )
    assert isinstance(req, CompletionRequest)
    assert req.max_tokens == 5 and req.temperature == 0.0 and req.include_usage
    assert req.stop_list() == ["x"] and req.top_k == 4 and req.ignore_eos


@pytest.mark.timeout(10)
def test_chat_fields_parse() -> None:
    req = _parse(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
            "max_completion_tokens": 3,
            "logprobs": True,
            "top_logprobs": 0,
        },
        ChatCompletionRequest,
    )
    assert isinstance(req, ChatCompletionRequest)
    assert req.max_completion_tokens == 3 and req.logprobs and not req.include_usage


@pytest.mark.timeout(10)
@pytest.mark.parametrize("body", [b"{not json", b"", b'{"prompt": "a"'])
def test_invalid_json_is_400(body: bytes) -> None:
    err = _error(body)
    assert err.status == 400 and err.info.code == "invalid_json"


@pytest.mark.timeout(10)
def test_non_object_body_is_400() -> None:
    err = _error([1, 2])
    assert err.status == 400 and "JSON object" in err.info.message


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "a", "temperature": "hot"}, "temperature"),
        ({"prompt": "a", "stream": "yes"}, "stream"),
        ({"prompt": "a", "max_tokens": True}, "max_tokens"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "a", "stop": 7}, "stop"),
        ({"prompt": "a", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ],
)
def test_wrong_types_name_the_field(body: dict, param: str) -> None:
    err = _error(body)
    assert err.status == 400 and err.info.param == param, err.info


@pytest.mark.timeout(10)
def test_missing_required_field() -> None:
    err = _error({"max_tokens": 3})
    assert err.status == 400 and err.info.param == "prompt" and err.info.code == "missing_field"
    err = _error({"model": "tiny"}, ChatCompletionRequest)
    assert err.info.param == "messages"


@pytest.mark.timeout(10)
def test_unknown_field_is_named() -> None:
    err = _error({"prompt": "a", "best_of": 2})
    assert err.status == 400 and err.info.param == "best_of" and "best_of" in err.info.message
    nested = _error({"messages": [{"role": "user", "content": "a", "mood": 1}]}, ChatCompletionRequest)
    assert nested.status == 400 and nested.info.param == "messages[0].mood", nested.info


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "field",
    [
        "kv_transfer_params",
        "remote_engine_id",
        "remote_host",
        "remote_port",
        "remote_block_ids",
        "transfer_id",
        "do_remote_prefill",
        "do_remote_decode",
        "kv_anything",
        "remote_anything",
    ],
)
def test_transfer_fields_are_refused(field: str) -> None:
    for type_, base in ((CompletionRequest, {"prompt": "a"}), (ChatCompletionRequest, {"messages": []})):
        err = _error({**base, field: {"x": 1}}, type_)
        assert err.status == 400 and err.info.param == field
        assert err.info.code == "transfer_field_not_allowed"
        assert "cannot set transfer parameters" in err.info.message


@pytest.mark.timeout(10)
def test_error_body_is_openai_shaped() -> None:
    body = json.loads(_error({"prompt": "a", "nope": 1}).body())
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
