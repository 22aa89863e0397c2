"""OpenAI response objects, whole and streamed (SSE ``data: {...}\\n\\n`` frames ending ``data: [DONE]``).

One formatter per request (``CompletionFormat`` or ``ChatFormat``) holds the request id, ``created``
and ``model``, and turns pipeline output into response bodies or SSE frames.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")
C = TypeVar("C")
L = TypeVar("L")

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int  # prompt tokens found in the prefix cache, not computed again


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0) -> Usage:
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_output_tokens,
        total_tokens=num_prompt_tokens + num_output_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
    )


class Envelope(msgspec.Struct, Generic[C], kw_only=True):
    """What every response and stream chunk has around its choices (``object`` names the kind)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[C]
    usage: Usage | None = None


# -- /v1/completions ---------------------------------------------------------------------------


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float]
    # One object per token. OpenAI returns the sampled token's logprob beside up to `logprobs`
    # alternatives; with `logprobs: 0` (the only value accepted) that is the sampled token alone.
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class Choice(msgspec.Struct, Generic[L], kw_only=True):
    """What every choice has; ``L`` is the endpoint's logprobs object."""

    index: int = 0
    logprobs: L | None = None
    finish_reason: str | None = None


class CompletionChoice(Choice[CompletionLogprobs], kw_only=True):
    text: str


class Completion(Envelope[CompletionChoice], kw_only=True):
    object: str = "text_completion"


# -- /v1/chat/completions ----------------------------------------------------------------------


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, Any]] = msgspec.field(default_factory=list)


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob]
    refusal: list[ChatTokenLogprob] | None = None  # never a refusal; OpenAI's schema requires the key


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str
    refusal: str | None = None  # never a refusal; OpenAI sends null, and its schema requires the key


class ChatChoice(Choice[ChatLogprobs], kw_only=True):
    message: AssistantMessage


class ChatCompletion(Envelope[ChatChoice], kw_only=True):
    object: str = "chat.completion"


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(Choice[ChatLogprobs], kw_only=True):
    delta: ChatDelta


class ChatCompletionChunk(Envelope[ChatChunkChoice], kw_only=True):
    object: str = "chat.completion.chunk"


# -- formatters --------------------------------------------------------------------------------


class _Format:
    """The request-wide fields, plus the frame and body builders both endpoints share."""

    prefix = ""
    whole_type: Callable[..., Any]
    chunk_type: Callable[..., Any]

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

    def _logprobs(self, token_ids: list[int], values: list[float] | None) -> Any:
        raise NotImplementedError

    def _chunk_choice(self, text: str, logprobs: Any, finish_reason: str | None) -> Any:
        raise NotImplementedError

    def _whole_choice(self, text: str, logprobs: Any, finish_reason: str | None) -> Any:
        raise NotImplementedError

    def chunk(
        self, text: str, token_ids: list[int], logprobs: list[float] | None, finish_reason: str | None
    ) -> bytes:
        """One SSE frame carrying ``text`` (the tokens' new text) and, on the last, the finish reason."""
        choice = self._chunk_choice(text, self._logprobs(token_ids, logprobs), finish_reason)
        return sse(self._envelope(self.chunk_type, [choice]))

    def usage_chunk(self, use: Usage) -> bytes:
        """The frame that ``stream_options.include_usage`` adds: no choices, only usage."""
        return sse(self._envelope(self.chunk_type, [], use))

    def whole(
        self,
        text: str,
        token_ids: list[int],
        logprobs: list[float] | None,
        finish_reason: str | None,
        use: Usage,
    ) -> bytes:
        """The JSON body of a request that does not stream."""
        choice = self._whole_choice(text, self._logprobs(token_ids, logprobs), finish_reason)
        return msgspec.json.encode(self._envelope(self.whole_type, [choice], use))


class CompletionFormat(_Format):
    """Bodies for ``/v1/completions`` (ids ``cmpl-...``)."""

    prefix = "cmpl"
    whole_type = chunk_type = Completion

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
        top = [{text: value} for text, value in zip(texts, values, strict=False)]
        return CompletionLogprobs(
            tokens=texts, token_logprobs=list(values), top_logprobs=top, text_offset=offsets
        )

    def _chunk_choice(self, text: str, logprobs: Any, finish_reason: str | None) -> CompletionChoice:
        return CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish_reason)

    _whole_choice = _chunk_choice


class ChatFormat(_Format):
    """Bodies for ``/v1/chat/completions`` (ids ``chatcmpl-...``)."""

    prefix = "chatcmpl"
    whole_type = ChatCompletion
    chunk_type = ChatCompletionChunk

    def _logprobs(self, token_ids: list[int], values: list[float] | None) -> ChatLogprobs | None:
        if not self.logprobs or values is None:
            return None
        entries = [
            ChatTokenLogprob(token=text, logprob=value, bytes=list(text.encode()))
            for text, value in zip(self._token_texts(token_ids), values, strict=False)
        ]
        return ChatLogprobs(content=entries)

    def role_chunk(self) -> bytes:
        """The first frame of a stream: the assistant role with empty content, as OpenAI sends it."""
        choice = ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))
        return sse(self._envelope(self.chunk_type, [choice]))

    def _chunk_choice(self, text: str, logprobs: Any, finish_reason: str | None) -> ChatChunkChoice:
        delta = ChatDelta(content=text) if text or finish_reason is None else ChatDelta()
        return ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish_reason)

    def _whole_choice(self, text: str, logprobs: Any, finish_reason: str | None) -> ChatChoice:
        return ChatChoice(
            message=AssistantMessage(content=text), logprobs=logprobs, finish_reason=finish_reason
        )
