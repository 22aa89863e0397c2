"""Response bodies and SSE frames, as the official OpenAI client parses them."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from moriio_ray.engine.tokenizer import ByteTokenizer
from moriio_ray.serve.responses import SSE_DONE, ChatFormat, CompletionFormat, sse, usage

DECODE = ByteTokenizer().decode


@pytest.mark.timeout(10)
def test_sse_framing() -> None:
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"


@pytest.mark.timeout(10)
def test_completion_body_parses_with_the_openai_types() -> None:
    fmt = CompletionFormat("tiny", DECODE, logprobs=True)
    raw = fmt.whole("hi", [104, 105], [-0.1, -0.2], "stop", usage(3, 2))
    parsed = Completion.model_validate(json.loads(raw))
    assert parsed.id.startswith("cmpl-") and parsed.choices[0].text == "hi"
    assert parsed.choices[0].finish_reason == "stop" and parsed.usage is not None
    assert parsed.usage.total_tokens == 5
    assert parsed.choices[0].logprobs is not None
    assert parsed.choices[0].logprobs.token_logprobs == [-0.1, -0.2]
    # logprobs: 0 lists no alternatives: each position holds the sampled token alone
    assert parsed.choices[0].logprobs.top_logprobs == [{"h": -0.1}, {"i": -0.2}]


@pytest.mark.timeout(10)
def test_completion_stream_offsets_continue_across_chunks() -> None:
    fmt = CompletionFormat("tiny", DECODE, logprobs=True)
    a = json.loads(fmt.chunk("ab", [97, 98], [-1.0, -1.0], None)[6:])
    b = json.loads(fmt.chunk("c", [99], [-1.0], "length")[6:])
    assert a["choices"][0]["logprobs"]["text_offset"] == [0, 1]
    assert b["choices"][0]["logprobs"]["text_offset"] == [2]
    assert a["id"] == b["id"] and b["choices"][0]["finish_reason"] == "length"


@pytest.mark.timeout(10)
def test_chat_bodies_parse_with_the_openai_types() -> None:
    fmt = ChatFormat("tiny", DECODE, logprobs=False)
    whole = ChatCompletion.model_validate(json.loads(fmt.whole("ok", [1], None, "stop", usage(1, 1))))
    assert whole.id.startswith("chatcmpl-") and whole.choices[0].message.content == "ok"
    frames = [fmt.role_chunk(), fmt.chunk("o", [111], None, None), fmt.chunk("", [], None, "stop")]
    chunks = [ChatCompletionChunk.model_validate(json.loads(f[6:])) for f in frames]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].delta.content == "o"
    assert chunks[2].choices[0].finish_reason == "stop" and chunks[2].choices[0].delta.content is None
    tail = ChatCompletionChunk.model_validate(json.loads(fmt.usage_chunk(usage(2, 3))[6:]))
    assert tail.choices == [] and tail.usage is not None and tail.usage.completion_tokens == 3
