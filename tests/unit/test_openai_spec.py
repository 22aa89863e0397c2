"""The OpenAPI -> JSON Schema conversion in tests/openai_spec.py, and that the schemas it yields are
strict enough to catch the replies issue 28 reported."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.openai_spec import COMPLETION_CHUNK, SCHEMAS_FILE, problems, source, to_json_schema

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(10)
def test_nullable_is_or_null_and_refs_point_into_defs() -> None:
    node = {
        "type": "object",
        "nullable": True,
        "properties": {
            "nullable": {"type": "string", "nullable": False},  # a property's name, not the keyword
            "usage": {"$ref": "#/components/schemas/CompletionUsage", "nullable": True},
        },
    }
    assert to_json_schema(node) == {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "nullable": {"type": "string"},
                    "usage": {"anyOf": [{"$ref": "#/$defs/CompletionUsage"}, {"type": "null"}]},
                },
            },
            {"type": "null"},
        ]
    }
    with pytest.raises(ValueError, match="components/schemas"):
        to_json_schema({"$ref": "#/components/responses/Oops"})


def _chat(message: dict[str, Any], logprobs: Any) -> dict[str, Any]:
    choice = {"index": 0, "finish_reason": "stop", "message": message, "logprobs": logprobs}
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice]}


def _completion(finish_reason: Any, logprobs: Any, usage: Any) -> dict[str, Any]:
    choice = {"index": 0, "text": "a", "finish_reason": finish_reason, "logprobs": logprobs}
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [choice],
        "usage": usage,
    }


TOKEN = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}
LOGPROBS = {"tokens": ["a"], "token_logprobs": [-0.5], "text_offset": [0]}


@pytest.mark.timeout(10)
def test_the_replies_of_issue_28_fail_and_their_fixes_pass() -> None:
    message = {"role": "assistant", "content": "a"}
    assert problems("CreateChatCompletionResponse", _chat(message, None)) == [
        "body.choices[0].message: 'refusal' is a required property"
    ]
    fixed = {**message, "refusal": None}
    assert problems("CreateChatCompletionResponse", _chat(fixed, {"content": [TOKEN]})) == [
        "body.choices[0].logprobs: 'refusal' is a required property"
    ]
    assert problems("CreateChatCompletionResponse", _chat(fixed, {"content": [TOKEN], "refusal": None})) == []

    null_top = _completion("stop", {**LOGPROBS, "top_logprobs": None}, None)
    assert problems(COMPLETION_CHUNK, null_top) == [
        "body.choices[0].logprobs.top_logprobs: None is not of type 'array'"
    ]
    fixed_top = _completion("stop", {**LOGPROBS, "top_logprobs": [{"a": -0.5}]}, None)
    assert problems(COMPLETION_CHUNK, fixed_top) == []


@pytest.mark.timeout(10)
def test_only_the_streamed_completion_allows_a_null_finish_reason_and_usage() -> None:
    chunk = _completion(None, None, None)
    assert problems(COMPLETION_CHUNK, chunk) == []
    where = {line.split(":")[0] for line in problems("CreateCompletionResponse", chunk)}
    assert where == {"body.choices[0].finish_reason", "body.usage"}
    assert problems(COMPLETION_CHUNK, _completion("bogus", None, None))  # still an enum


@pytest.mark.timeout(10)
def test_the_trimmed_copy_names_its_source_and_the_docs_name_the_same_commit() -> None:
    info = source()
    assert info["repository"] == "openai/openai-openapi" and len(info["commit"]) == 40
    assert (SCHEMAS_FILE.parent / "LICENSE.openai-openapi").read_text().startswith("The MIT License")
    for doc in (SCHEMAS_FILE.parent / "README.md", ROOT / "docs" / "openai_api.md"):
        assert info["commit"][:12] in doc.read_text(), f"{doc.name} does not name the spec's commit"
