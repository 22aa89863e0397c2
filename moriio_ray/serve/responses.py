"""OpenAI response objects, whole and streamed (SSE ``data: {...}\\n\\n`` frames ending ``data: [DONE]``).

One formatter per request (``CompletionFormat`` or ``ChatFormat``) holds the request id, ``created``
and ``model``, and turns pipeline output into response bodies or SSE frames.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
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
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing before it)
    # One object per token: the sampled token's logprob beside up to `logprobs` alternatives (with
    # `logprobs: 0`, the sampled token alone); None for an echoed prompt's first token, as OpenAI.
    top_logprobs: list[dict[str, float] | None]
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

# a token's alternatives, as the engine returns them: (token id, raw log probability), best first
Tops = list[tuple[int, float]]


class _Format:
    """The request-wide fields, plus the frame and body builders both endpoints share.

    A request's choices are indexed 0..N-1 (``n`` per prompt, prompts in order); ``top`` is the
    number of alternatives per token (``logprobs`` / ``top_logprobs``)."""

    prefix = ""
    whole_type: Callable[..., Any]
    chunk_type: Callable[..., Any]

    def __init__(
        self, model: str, decode: Callable[[list[int]], str], *, logprobs: bool, top: int = 0
    ) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.decode = decode
        self.logprobs = logprobs
        self.top = top

    def _token_texts(self, token_ids: list[int]) -> list[str]:
        return [self.decode([t]) for t in token_ids]

    def _envelope(self, cls: Callable[..., T], choices: list[Any], use: Usage | None = None) -> T:
        return cls(id=self.id, created=self.created, model=self.model, choices=choices, usage=use)

    def _logprobs(
        self, index: int, token_ids: list[int], values: Sequence[float | None] | None, tops: list[Tops] | None
    ) -> Any:
        raise NotImplementedError

    def _chunk_choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None) -> Any:
        raise NotImplementedError

    def _whole_choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None) -> Any:
        raise NotImplementedError

    def chunk(
        self,
        text: str,
        token_ids: list[int],
        logprobs: Sequence[float | None] | None,
        finish_reason: str | None,
        *,
        index: int = 0,
        tops: list[Tops] | None = None,
    ) -> bytes:
        """One SSE frame carrying choice ``index``'s new text and, on its last, the finish reason."""
        lp = self._logprobs(index, token_ids, logprobs, tops)
        choice = self._chunk_choice(index, text, lp, finish_reason)
        return sse(self._envelope(self.chunk_type, [choice]))

    def usage_chunk(self, use: Usage) -> bytes:
        """The frame that ``stream_options.include_usage`` adds: no choices, only usage."""
        return sse(self._envelope(self.chunk_type, [], use))

    def whole_choice(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        logprobs: list[float] | None,
        finish_reason: str | None,
        tops: list[Tops] | None = None,
    ) -> Any:
        """Choice ``index`` of a body (``body`` puts the choices together)."""
        return self._whole_choice(
            index, text, self._logprobs(index, token_ids, logprobs, tops), finish_reason
        )

    def body(self, choices: list[Any], use: Usage) -> bytes:
        """The JSON body of a request that does not stream."""
        return msgspec.json.encode(self._envelope(self.whole_type, choices, use))

    def whole(
        self,
        text: str,
        token_ids: list[int],
        logprobs: list[float] | None,
        finish_reason: str | None,
        use: Usage,
        *,
        tops: list[Tops] | None = None,
    ) -> bytes:
        """The JSON body of a one-choice request that does not stream."""
        return self.body([self.whole_choice(0, text, token_ids, logprobs, finish_reason, tops)], use)


class CompletionFormat(_Format):
    """Bodies for ``/v1/completions`` (ids ``cmpl-...``). ``echo``: per choice, the text (and, with
    logprobs, the prompt's tokens and their log probabilities) put in front of its completion."""

    prefix = "cmpl"
    whole_type = chunk_type = Completion

    def __init__(
        self, model: str, decode: Callable[[list[int]], str], *, logprobs: bool, top: int = 0
    ) -> None:
        super().__init__(model, decode, logprobs=logprobs, top=top)
        self._offsets: dict[int, int] = {}  # per choice: text_offset of its next token

    def _logprobs(
        self, index: int, token_ids: list[int], values: Sequence[float | None] | None, tops: list[Tops] | None
    ) -> CompletionLogprobs | None:
        if not self.logprobs or values is None:
            return None
        texts = self._token_texts(token_ids)
        offsets = []
        offset = self._offsets.get(index, 0)
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        top: list[dict[str, float] | None] = []
        for i, (text, value) in enumerate(zip(texts, values, strict=False)):
            if value is None:  # a prompt's first token has no log probability (OpenAI: null)
                top.append(None)
                continue
            # the sampled token always has its entry, beside up to `logprobs` alternatives
            alternatives = {text: value}
            for token, lp in (tops[i] if tops is not None and i < len(tops) else [])[: self.top]:
                if token == token_ids[i]:
                    continue
                key = self.decode([token])
                # tokens whose texts coincide (a byte of a character each) keep apart under their ids
                alternatives[key if key not in alternatives else f"token_id:{token}"] = lp
            top.append(alternatives)
        return CompletionLogprobs(
            tokens=texts, token_logprobs=list(values), top_logprobs=top, text_offset=offsets
        )

    def _chunk_choice(
        self, index: int, text: str, logprobs: Any, finish_reason: str | None
    ) -> CompletionChoice:
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)

    def _whole_choice(
        self, index: int, text: str, logprobs: Any, finish_reason: str | None
    ) -> CompletionChoice:
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)


class ChatFormat(_Format):
    """Bodies for ``/v1/chat/completions`` (ids ``chatcmpl-...``)."""

    prefix = "chatcmpl"
    whole_type = ChatCompletion
    chunk_type = ChatCompletionChunk

    def _logprobs(
        self, index: int, token_ids: list[int], values: Sequence[float | None] | None, tops: list[Tops] | None
    ) -> ChatLogprobs | None:
        if not self.logprobs or values is None:
            return None
        entries = []
        for i, (text, value) in enumerate(zip(self._token_texts(token_ids), values, strict=False)):
            assert value is not None  # only an echoed prompt has a token without one, and chat never echoes
            alternatives = [
                {"token": (t := self.decode([token])), "logprob": lp, "bytes": list(t.encode())}
                for token, lp in (tops[i] if tops is not None and i < len(tops) else [])[: self.top]
            ]
            entries.append(
                ChatTokenLogprob(
                    token=text, logprob=value, bytes=list(text.encode()), top_logprobs=alternatives
                )
            )
        return ChatLogprobs(content=entries)

    def role_chunk(self, index: int = 0) -> bytes:
        """The first frame of a choice's stream: the assistant role with empty content, as OpenAI
        sends it."""
        choice = ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))
        return sse(self._envelope(self.chunk_type, [choice]))

    def _chunk_choice(
        self, index: int, text: str, logprobs: Any, finish_reason: str | None
    ) -> ChatChunkChoice:
        delta = ChatDelta(content=text) if text or finish_reason is None else ChatDelta()
        return ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)

    def _whole_choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None) -> ChatChoice:
        return ChatChoice(
            index=index,
            message=AssistantMessage(content=text),
            logprobs=logprobs,
            finish_reason=finish_reason,
        )
