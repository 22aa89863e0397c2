"""OpenAI request schemas and their parsing: JSON bytes -> a validated Struct, or a 400 naming the field.

Accepted fields are the OpenAI ones this server supports plus three extensions (``top_k``,
``stop_token_ids``, ``ignore_eos``). A field it does not know is a 400 naming it. Transfer
parameters and peer addresses (vLLM's ``kv_transfer_params``, ``remote_host``, ...) have no place in
this API: every peer comes from the coordinator, so such a field is a 400 saying clients cannot set it.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from moriio_ray.serve.errors import APIError, bad_request

T = TypeVar("T")

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


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields common to both endpoints."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    # extensions (vLLM names)
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/completions``. ``prompt`` is a string or a list of token ids (one prompt)."""

    prompt: str | list[Any]
    logprobs: int | None = None  # only 0: the sampled token's log probability, no alternatives


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
    logprobs: bool = False
    top_logprobs: int | None = None  # only 0 or null


CHAT_ROLES = ("system", "developer", "user", "assistant")


def parse_request(body: bytes, type_: type[T]) -> T:
    """Decode and validate a request body, raising a 400 APIError that names the offending field."""
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
    if unknown:
        raise bad_request(
            f"unknown field {unknown[0]!r}; this server accepts: {', '.join(sorted(allowed))}",
            param=unknown[0],
            code="unknown_field",
        )
    try:
        return msgspec.convert(data, type_)
    except msgspec.ValidationError as exc:
        raise _validation_error(exc) from None
    except RecursionError:
        raise bad_request("the body is nested too deeply to be a request", code="invalid_json") from None


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
