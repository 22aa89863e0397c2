"""OpenAI request schemas and their parsing: JSON bytes -> a validated Struct, or a 400 naming the field.

Every field of OpenAI's completions and chat request schemas is honoured, accepted and ignored where
ignoring it cannot change the answer (``IGNORED_FIELDS``), or refused with a 400 naming it where it
would (``REFUSED_FIELDS``, unless set to its neutral value). Extensions (vLLM's names): ``top_k``,
``stop_token_ids``, ``ignore_eos``, ``min_tokens``, ``repetition_penalty``. A field it does not know
is a 400 naming it, or ignored and reported (``serve.unknown_fields``). Transfer
parameters and peer addresses (vLLM's ``kv_transfer_params``, ``remote_host``, ...) have no place in
this API: every peer comes from the coordinator, so such a field is a 400 saying clients cannot set it.
"""

from __future__ import annotations

import logging
import re
from typing import Any, TypeVar

import msgspec

from moriio_ray.serve.errors import APIError, bad_request

T = TypeVar("T")
log = logging.getLogger(__name__)

# Field names through which vLLM-style connectors pass transfer state between servers.
TRANSFER_FIELDS = frozenset(
    {
        "kv_transfer_params",
        "transfer_id",
        "do_remote_prefill",
        "do_remote_decode",
        "remote_engine_id",
        "remote_host",
        "remote_port",
        "remote_block_ids",
        "remote_handshake_port",
        "remote_notify_port",
        "remote_dp_size",
        "remote_tp_size",
    }
)
TRANSFER_PREFIXES = ("kv_", "remote_")


MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_CHOICES = 128  # prompts x n

# Fields of OpenAI's request schemas that this server accepts and ignores, because ignoring them
# cannot change the answer; each with the reason (docs/openai_api.md lists them).
IGNORED_FIELDS: dict[str, str] = {
    "user": "an end-user id for abuse monitoring; it does not change the output",
    "metadata": "tags for stored completions; nothing is stored",
    "store": "storing completions for distillation or evals; nothing is stored",
    "service_tier": "a billing and latency tier; there is one tier",
    "safety_identifier": "an end-user id for abuse monitoring; it does not change the output",
    "prompt_cache_key": "a routing hint for prompt caches; it does not change the output",
    "prompt_cache_retention": "how long a prompt cache is kept; it does not change the output",
    "prompt_cache_options": "prompt cache settings; they do not change the output",
    "prediction": "a predicted output only speeds a reply up; it never changes it",
    "parallel_tool_calls": "tools are refused, so it has nothing to act on",
    "reasoning_effort": "the served model does not reason: there are no reasoning tokens to limit",
}

# Fields refused with a 400 (naming them) when set to anything but their neutral value, because
# ignoring them would change the answer; each with the reason.
REFUSED_FIELDS: dict[str, str] = {
    "tools": "tool calling is not supported; send no tools",
    "tool_choice": "tool calling is not supported; only 'none' or 'auto' without tools",
    "functions": "function calling is not supported; send no functions",
    "function_call": "function calling is not supported; only 'none' or 'auto' without functions",
    "audio": "audio output is not supported; the model writes text",
    "modalities": "only the 'text' modality is supported",
    "web_search_options": "web search is not supported",
    "moderation": "moderation is not run here; send no moderation settings",
    "verbosity": "the response's verbosity cannot be steered; only 'medium' (the default)",
    "suffix": "inserting text before a suffix is not supported",
    "best_of": "server-side best-of selection is not supported; use n and choose client-side",
}


def _neutral(name: str, value: Any, req: Any) -> bool:
    """Whether a refused field's value is one that changes nothing."""
    if value is None:
        return True
    match name:
        case "tools" | "functions":
            return value == []
        case "tool_choice" | "function_call":
            return value in ("none", "auto")
        case "modalities":
            return isinstance(value, list) and all(m == "text" for m in value)
        case "verbosity":
            return value == "medium"
        case "suffix":
            return value == ""
        case "best_of":
            return value == req.n
    return False


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: Any = None  # ignored: padding against side channels; it does not change the text


class SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields common to both endpoints."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON's keys) -> bias
    user: Any = None  # ignored (IGNORED_FIELDS)
    # extensions (vLLM names)
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/completions``. ``prompt`` is a string, a list of token ids, or a list of either
    (one choice set per prompt)."""

    prompt: str | list[Any]
    logprobs: int | None = None  # alternatives per token, 0..20 (0: the sampled token alone)
    echo: bool | None = False  # the prompt in front of the completion (with logprobs, its logprobs too)
    suffix: Any = None  # refused unless empty (REFUSED_FIELDS)
    best_of: Any = None  # refused unless equal to n


class TextPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    text: str = ""


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None  # alternatives per token, 0..20; needs logprobs
    response_format: dict[str, Any] | None = None
    # refused unless neutral (REFUSED_FIELDS)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None
    moderation: Any = None
    verbosity: Any = None
    # ignored (IGNORED_FIELDS)
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    prediction: Any = None
    parallel_tool_calls: Any = None
    reasoning_effort: Any = None


CHAT_ROLES = ("system", "developer", "user", "assistant")


UNKNOWN_FIELDS = ("reject", "ignore")
_MAX_LOGGED = 1024  # distinct ignored names logged (a client cannot grow the set without bound)
_logged: set[str] = set()


def parse_request(
    body: bytes, type_: type[T], *, unknown_fields: str = "reject", ignored: list[str] | None = None
) -> T:
    """Decode and validate a request body, raising a 400 APIError that names the offending field.

    A field this server does not know is a 400 (``unknown_fields="reject"``) or dropped
    (``"ignore"``): its name goes into ``ignored`` and, once per name, into the log. A refused
    field (``REFUSED_FIELDS``) set to a value that would change the answer is a 400 naming it."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:  # malformed, bad encoding, a number out of range, ...
        raise bad_request(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("the body is nested too deeply to be a request", code="invalid_json") from None
    except Exception as exc:  # whatever else a decoder may raise on hostile bytes is still bad input
        raise bad_request(f"the body is not valid JSON ({type(exc).__name__})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"the body must be a JSON object, not {_json_kind(data)}", code="invalid_json")
    _reject_transfer_fields(data)
    allowed = set(type_.__struct_fields__)  # type: ignore[attr-defined]
    unknown = sorted(k for k in data if k not in allowed)
    if unknown and unknown_fields == "ignore":
        for name in unknown:
            del data[name]
            _log_ignored(name)
        if ignored is not None:
            ignored += unknown
    elif unknown:
        raise bad_request(
            f"unknown field {unknown[0]!r}; this server accepts: {', '.join(sorted(allowed))}",
            param=unknown[0],
            code="unknown_field",
        )
    try:
        req = msgspec.convert(data, type_)
    except msgspec.ValidationError as exc:
        raise _validation_error(exc) from None
    except RecursionError:
        raise bad_request("the body is nested too deeply to be a request", code="invalid_json") from None
    for name, reason in REFUSED_FIELDS.items():
        if name in allowed and not _neutral(name, getattr(req, name), req):
            raise bad_request(f"{name}: {reason}", param=name, code="unsupported_field")
    return req


def _log_ignored(name: str) -> None:
    if name not in _logged and len(_logged) < _MAX_LOGGED:
        _logged.add(name)
        log.warning("ignoring the request field %r, which this server does not know", name[:100])


def _reject_transfer_fields(data: dict[str, Any]) -> None:
    for key in data:
        if key in TRANSFER_FIELDS or key.startswith(TRANSFER_PREFIXES):
            raise bad_request(
                f"{key!r}: clients cannot set transfer parameters or peer addresses; the pipeline "
                "chooses prefill and decode workers itself. Remove the field.",
                param=key,
                code="transfer_field_not_allowed",
            )


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def _validation_error(exc: msgspec.ValidationError) -> APIError:
    match = _AT.match(str(exc))
    assert match is not None  # the pattern matches any string
    path = (match.group("path") or "").lstrip(".")
    msg = match.group("msg")
    unknown = re.match(r"Object contains unknown field `(?P<f>[^`]+)`", msg)
    if unknown:
        field = ".".join(p for p in (path, unknown.group("f")) if p)
        return bad_request(f"unknown field {field!r}", param=field, code="unknown_field")
    missing = re.match(r"Object missing required field `(?P<f>[^`]+)`", msg)
    if missing:
        field = ".".join(p for p in (path, missing.group("f")) if p)
        return bad_request(f"{field!r} is required", param=field, code="missing_field")
    return bad_request(f"{path or 'body'}: {msg}", param=path or None, code="invalid_type")


def _json_kind(value: Any) -> str:
    return {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}.get(
        type(value), "null"
    )
