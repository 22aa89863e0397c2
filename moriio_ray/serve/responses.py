"""OpenAI response objects, whole and streamed (SSE ``data: {...}\\n\\n`` frames ending ``data: [DONE]``).

One formatter per request (``CompletionFormat`` or ``ChatFormat``) holds the request id, ``created``
and ``model``, and turns pipeline output into response bodies or SSE frames.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def usage(num_prompt_tokens: int, num_output_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_output_tokens,
        total_tokens=num_prompt_tokens + num_output_tokens,
    )


# -- /v1/completions ---------------------------------------------------------------------------


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None  # alternatives are not returned
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


# -- /v1/chat/completions ----------------------------------------------------------------------


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, Any]] = msgspec.field(default_factory=list)


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob]


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# -- formatters --------------------------------------------------------------------------------


class _Format:
    prefix = ""

    def __init__(self, model: str, decode: Callable[[list[int]], str], *, logprobs: bool) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.decode = decode
        self.logprobs = logprobs

    def _token_texts(self, token_ids: list[int]) -> list[str]:
        return [self.decode([t]) for t in token_ids]

    def _envelope(self, cls: Callable[..., T], choices: list[Any], use: Usage | None = None) -> T:
        return cls(id=self.id, created=self.created, model=self.model, choices=choices, usage=use)


class CompletionFormat(_Format):
    """Bodies for ``/v1/completions`` (ids ``cmpl-...``)."""

    prefix = "cmpl"

    def __init__(self, model: str, decode: Callable[[list[int]], str], *, logprobs: bool) -> None:
        super().__init__(model, decode, logprobs=logprobs)
        self._offset = 0  # text_offset of the next token

    def _logprobs(self, token_ids: list[int], values: list[float] | None) -> CompletionLogprobs | None:
        if not self.logprobs or values is None:
            return None
        texts = self._token_texts(token_ids)
        offsets = []
        for text in texts:
            offsets.append(self._offset)
            self._offset += len(text)
        return CompletionLogprobs(tokens=texts, token_logprobs=list(values), text_offset=offsets)

    def chunk(
        self, text: str, token_ids: list[int], logprobs: list[float] | None, finish_reason: str | None
    ) -> bytes:
        choice = CompletionChoice(
            text=text, logprobs=self._logprobs(token_ids, logprobs), finish_reason=finish_reason
        )
        return sse(self._envelope(Completion, [choice]))

    def usage_chunk(self, use: Usage) -> bytes:
        return sse(self._envelope(Completion, [], use))

    def whole(
        self,
        text: str,
        token_ids: list[int],
        logprobs: list[float] | None,
        finish_reason: str | None,
        use: Usage,
    ) -> bytes:
        choice = CompletionChoice(
            text=text, logprobs=self._logprobs(token_ids, logprobs), finish_reason=finish_reason
        )
        return msgspec.json.encode(self._envelope(Completion, [choice], use))


class ChatFormat(_Format):
    """Bodies for ``/v1/chat/completions`` (ids ``chatcmpl-...``)."""

    prefix = "chatcmpl"

    def _logprobs(self, token_ids: list[int], values: list[float] | None) -> ChatLogprobs | None:
        if not self.logprobs or values is None:
            return None
        entries = [
            ChatTokenLogprob(token=text, logprob=value, bytes=list(text.encode()))
            for text, value in zip(self._token_texts(token_ids), values, strict=False)
        ]
        return ChatLogprobs(content=entries)

    def _chunk(self, choice: ChatChunkChoice) -> bytes:
        return sse(self._envelope(ChatCompletionChunk, [choice]))

    def role_chunk(self) -> bytes:
        """The first frame of a stream: the assistant role with empty content, as OpenAI sends it."""
        return self._chunk(ChatChunkChoice(delta=ChatDelta(role="assistant", content="")))

    def chunk(
        self, text: str, token_ids: list[int], logprobs: list[float] | None, finish_reason: str | None
    ) -> bytes:
        delta = ChatDelta(content=text) if text or finish_reason is None else ChatDelta()
        lps = self._logprobs(token_ids, logprobs)
        return self._chunk(ChatChunkChoice(delta=delta, logprobs=lps, finish_reason=finish_reason))

    def usage_chunk(self, use: Usage) -> bytes:
        return sse(self._envelope(ChatCompletionChunk, [], use))

    def whole(
        self,
        text: str,
        token_ids: list[int],
        logprobs: list[float] | None,
        finish_reason: str | None,
        use: Usage,
    ) -> bytes:
        choice = ChatChoice(
            message=AssistantMessage(content=text),
            logprobs=self._logprobs(token_ids, logprobs),
            finish_reason=finish_reason,
        )
        return msgspec.json.encode(self._envelope(ChatCompletion, [choice], use))
