"""The field policy against the official ``openai`` client's request types: every field it can send
is honoured, ignored where that cannot change the answer, or refused with a 400 naming it; unknown
fields follow ``serve.unknown_fields``; ``n`` and lists of prompts fan out into indexed choices."""

from __future__ import annotations

import asyncio
import json
import re
import typing
from pathlib import Path
from typing import Any

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from moriio_ray.serve.handler import IGNORED_HEADER, JSONReply, StreamReply
from moriio_ray.serve.openai import (
    IGNORED_FIELDS,
    REFUSED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
)
from tests.unit.test_serve_handler import FakePipeline, _server

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = {"prompt": "hey"}
MESSAGES = {"messages": [{"role": "user", "content": "hey"}]}


def _client_fields(module: Any) -> set[str]:
    """Every field the openai client's TypedDicts for one endpoint can send."""
    names: set[str] = set()
    for name in ("CompletionCreateParamsNonStreaming", "CompletionCreateParamsStreaming"):
        names |= set(typing.get_type_hints(getattr(module, name)))
    return names


CLIENT = {COMPLETIONS: _client_fields(completion_create_params), CHAT: _client_fields(chat_create_params)}
SCHEMA = {COMPLETIONS: CompletionRequest, CHAT: ChatCompletionRequest}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_every_client_field_has_a_place(path: str) -> None:
    fields = CLIENT[path]
    assert len(fields) > 15 and {"model", "stream", "n", "logit_bias"} <= fields  # the enumeration works
    known = set(SCHEMA[path].__struct_fields__)
    assert fields - known == set(), "fields the client sends that the server would treat as unknown"
    hints = typing.get_type_hints(chat_create_params.ChatCompletionStreamOptionsParam)
    assert set(hints) <= set(StreamOptions.__struct_fields__)


def _ask(
    path: str, body: dict[str, Any], *, unknown_fields: str = "ignore", pipe: FakePipeline | None = None
) -> tuple[int, Any, dict[str, str]]:
    """(status, parsed body or SSE events, headers)."""

    async def go() -> tuple[int, Any, dict[str, str]]:
        server = _server(pipe or FakePipeline(), limit=32, roles={}, unknown_fields=unknown_fields)
        reply = await server.handle("POST", path, json.dumps(body).encode())
        if isinstance(reply, JSONReply):
            return reply.status, json.loads(reply.body), reply.headers
        assert isinstance(reply, StreamReply)
        frames = [f async for f in reply.frames]
        await reply.close()
        assert frames[-1] == b"data: [DONE]\n\n"
        return 200, [json.loads(f[6:]) for f in frames[:-1]], reply.headers

    return asyncio.run(go())


IGNORED_VALUES: dict[str, Any] = {
    "user": "u-1",
    "metadata": {"k": "v"},
    "store": True,
    "service_tier": "flex",
    "safety_identifier": "s",
    "prompt_cache_key": "c",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "1h"},
    "prediction": {"type": "content", "content": "hey"},
    "parallel_tool_calls": True,
    "reasoning_effort": "low",
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("name", sorted(IGNORED_FIELDS))
def test_ignored_fields_change_nothing(name: str) -> None:
    path = COMPLETIONS if name == "user" else CHAT
    base = PROMPT if path == COMPLETIONS else MESSAGES
    status, plain, _ = _ask(path, base)
    status_with, body, headers = _ask(path, {**base, name: IGNORED_VALUES[name]}, unknown_fields="reject")
    assert status == status_with == 200, body
    assert body["choices"] == plain["choices"] and IGNORED_HEADER not in headers


REFUSED_VALUES: dict[str, tuple[Any, Any]] = {  # (a value that changes the answer, a neutral one)
    "tools": ([{"type": "function", "function": {"name": "f"}}], []),
    "tool_choice": ("required", "none"),
    "functions": ([{"name": "f"}], []),
    "function_call": ({"name": "f"}, "auto"),
    "audio": ({"voice": "alloy", "format": "wav"}, None),
    "modalities": (["text", "audio"], ["text"]),
    "web_search_options": ({}, None),
    "moderation": ({"model": "omni-moderation-latest"}, None),
    "verbosity": ("low", "medium"),
    "suffix": ("tail", ""),
    "best_of": (3, 1),
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("name", sorted(REFUSED_FIELDS))
def test_refused_fields_are_400s_naming_them_unless_neutral(name: str) -> None:
    path = COMPLETIONS if name in CompletionRequest.__struct_fields__ else CHAT
    base = PROMPT if path == COMPLETIONS else MESSAGES
    bad, neutral = REFUSED_VALUES[name]
    status, body, _ = _ask(path, {**base, name: bad})
    assert status == 400 and body["error"]["param"] == name, body
    assert body["error"]["message"].startswith(name)
    status, body, _ = _ask(path, {**base, name: neutral})
    assert status == 200, body


@pytest.mark.timeout(20)
def test_unknown_fields_follow_the_switch() -> None:
    body = {**PROMPT, "mood": "sunny", "zeta": 1}
    status, reply, headers = _ask(COMPLETIONS, body)
    assert status == 200 and headers[IGNORED_HEADER] == "mood, zeta"
    assert reply["choices"][0]["text"] == "hey"
    status, events, headers = _ask(COMPLETIONS, {**body, "stream": True})
    assert status == 200 and headers[IGNORED_HEADER] == "mood, zeta" and events
    status, reply, _ = _ask(COMPLETIONS, body, unknown_fields="reject")
    assert status == 400 and reply["error"]["param"] == "mood"
    # transfer fields stay refused whatever the switch says
    for name in ("kv_transfer_params", "remote_host", "kv_x"):
        status, reply, _ = _ask(COMPLETIONS, {**PROMPT, name: 1})
        assert status == 400 and reply["error"]["code"] == "transfer_field_not_allowed", reply


@pytest.mark.timeout(20)
def test_n_and_prompt_lists_fan_out_into_indexed_choices() -> None:
    pipe = FakePipeline()
    body = {"prompt": ["ab", [99, 100, 101]], "n": 3, "max_tokens": 3, "seed": 5, "temperature": 1}
    status, reply, _ = _ask(COMPLETIONS, body, pipe=pipe)
    assert status == 200, reply
    choices = reply["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    assert [c["text"] for c in choices] == ["ab"] * 3 + ["cde"] * 3
    # prompt tokens (and the FAKE's cached half of each prompt) once per prompt, completion tokens per choice
    assert reply["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2 * 3 + 3 * 3,
        "total_tokens": 20,
        "prompt_tokens_details": {"cached_tokens": 1 + 1},
    }
    assert len(pipe.finished) == 6 and len(set(pipe.finished)) == 6 and not pipe.closed
    status, events, _ = _ask(COMPLETIONS, {**body, "stream": True, "stream_options": {"include_usage": True}})
    texts: dict[int, str] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {i: c["text"] for i, c in enumerate(choices)}
    assert events[-1]["usage"] == reply["usage"] and events[-1]["choices"] == []
    status, reply, _ = _ask(COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 11})  # 33 > the limit of 32
    assert status == 400 and reply["error"]["param"] == "n", reply
    status, reply, _ = _ask(CHAT, {**MESSAGES, "n": 2})
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert reply["choices"][0]["message"] == reply["choices"][1]["message"]


@pytest.mark.timeout(20)
def test_seeded_choices_draw_apart() -> None:
    seen: list[Any] = []

    class Recording(FakePipeline):
        def make_request(
            self, prompt: Any = None, *, token_ids: Any = None, params: Any = None, request_id: Any = None
        ):
            seen.append(params.seed)
            return super().make_request(prompt, token_ids=token_ids, params=params, request_id=request_id)

    _ask(COMPLETIONS, {**PROMPT, "n": 4, "seed": 2**64 - 2, "temperature": 1}, pipe=Recording())
    assert seen == [2**64 - 2, 2**64 - 1, 0, 1]


@pytest.mark.timeout(20)
def test_echo_and_max_tokens_zero() -> None:
    status, reply, _ = _ask(COMPLETIONS, {**PROMPT, "echo": True, "max_tokens": 2})
    assert status == 200 and reply["choices"][0]["text"] == "heyhe"
    status, reply, _ = _ask(COMPLETIONS, {**PROMPT, "echo": True, "max_tokens": 0, "n": 2})
    assert [c["text"] for c in reply["choices"]] == ["hey", "hey"]
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 0,
        "total_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 0},  # nothing was looked up
    }
    status, events, _ = _ask(COMPLETIONS, {**PROMPT, "echo": True, "max_tokens": 2, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events) == "heyhe"
    status, reply, _ = _ask(COMPLETIONS, {**PROMPT, "max_tokens": 0})
    assert status == 400 and reply["error"]["param"] == "max_tokens"


@pytest.mark.timeout(20)
def test_tokenize_and_detokenize() -> None:
    async def go(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        reply = await _server(FakePipeline(), roles={}).handle("POST", path, json.dumps(body).encode())
        assert isinstance(reply, JSONReply)
        return reply.status, json.loads(reply.body)

    assert asyncio.run(go("/tokenize", {"prompt": "hey"})) == (
        200,
        {"tokens": [104, 101, 121], "count": 3, "max_model_len": 64},
    )
    status, body = asyncio.run(go("/tokenize", MESSAGES))
    assert status == 200 and bytes(body["tokens"]).decode() == "user: hey\nassistant:"
    assert asyncio.run(go("/detokenize", {"tokens": [104, 105]})) == (200, {"prompt": "hi"})
    for path, bad, param in [
        ("/detokenize", {"tokens": [10**6]}, "tokens"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", **MESSAGES}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model"),
    ]:
        status, body = asyncio.run(go(path, bad))
        assert status in (400, 404) and body["error"]["param"] == param, body


@pytest.mark.timeout(10)
def test_the_docs_list_every_client_field() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "openai_api.md").read_text()
    listed = set(re.findall(r"`([a-z_]+)", page))
    missing = sorted((CLIENT[COMPLETIONS] | CLIENT[CHAT]) - listed)
    assert not missing, f"the field table of docs/openai_api.md does not list {missing}"
    assert set(IGNORED_FIELDS) | set(REFUSED_FIELDS) <= listed
