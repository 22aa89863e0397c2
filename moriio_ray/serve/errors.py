"""OpenAI-shaped HTTP errors, and the mapping from this package's typed errors to them.

Every error the front end answers has the body ``{"error": {"message", "type", "param", "code"}}``.
Malformed input is always a 4xx; a 5xx means the pipeline itself failed or is unavailable. A body
never carries a traceback, a file path or terminal colour codes: a 503 says in one line what is
unavailable, and a 500 only names the request id, with the detail in the server log.
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid

import msgspec

from moriio_ray.errors import (
    CapacityError,
    ConfigError,
    DeadlineExceeded,
    EngineFailed,
    InvalidRequest,
    Overloaded,
    RequestCancelled,
    TransferError,
)

log = logging.getLogger(__name__)
MAX_MESSAGE_CHARS = 300


class ErrorInfo(msgspec.Struct, kw_only=True):
    """The inner object of an OpenAI error body."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct, kw_only=True):
    error: ErrorInfo


class APIError(Exception):
    """An error answered to the client with ``status`` and an OpenAI-shaped body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def body(self) -> bytes:
        """The JSON body: ``{"error": {...}}``."""
        return msgspec.json.encode(ErrorBody(error=self.info))


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param, code=code)


def overloaded(limit: int) -> APIError:
    """The 429 answered once ``limit`` requests are already in flight on this replica."""
    return APIError(
        429,
        f"this server is busy: {limit} requests are already in flight; retry shortly",
        type="rate_limit_error",
        code="too_many_requests",
    )


def too_large(num_bytes: int, limit_bytes: int) -> APIError:
    """The 413 for a request body over the limit."""
    return APIError(413, f"the body is {num_bytes} bytes; the limit is {limit_bytes}", code="too_large")


def unavailable(message: str) -> APIError:
    """A 503: the pipeline cannot take requests now (no live workers, a worker died, a deadline)."""
    return APIError(503, message, type="server_error", code="service_unavailable")


# `field: message` at the start of an InvalidRequest raised by SamplingParams or the tokenizer
_FIELD_PREFIX = re.compile(r"^(?P<field>[A-Za-z_][A-Za-z0-9_\[\]\.]*): ")


def internal_error(request_id: str | None = None) -> APIError:
    """The 500 a client sees for a fault of the server: a generic message and the request id (the
    caller logs the detail under that id)."""
    rid = request_id or uuid.uuid4().hex
    return APIError(
        500,
        f"the server failed to serve this request (request id {rid}); the details are in its log",
        type="server_error",
        code="internal_error",
    )


def from_exception(
    exc: BaseException,
    *,
    validating: bool,
    request_id: str | None = None,
    fields: dict[str, str] | None = None,
) -> APIError:
    """The APIError for an exception raised while serving a request.

    ``validating`` is True while the request is being checked and tokenized (before any engine
    work): a CapacityError there means the prompt cannot fit (400); later it means that no worker
    could take the request (503). Anything unexpected is a generic 500 (``internal_error``), its
    detail logged under ``request_id``. ``fields`` renames the pipeline's field names in a
    validation error to the request's own (``max_tokens`` -> ``max_completion_tokens``).
    """
    if isinstance(exc, APIError):
        return exc
    exc = _cause(exc)
    text = public_text(exc)
    if isinstance(exc, (InvalidRequest, CapacityError)) and validating:
        match = _FIELD_PREFIX.match(text)
        field = match.group("field") if match else None
        renames = fields or {}
        if field is not None and field in renames:
            text, field = renames[field] + text[len(field) :], renames[field]
        if "max_tokens" in renames:  # also where the message says what to lower
            text = re.sub(r"\bmax_tokens\b", renames["max_tokens"], text)
        if isinstance(exc, CapacityError):
            return bad_request(text, param=field or "max_tokens", code="context_length_exceeded")
        return bad_request(text, param=field)
    if isinstance(exc, InvalidRequest):
        match = _FIELD_PREFIX.match(text)
        return bad_request(text, param=match.group("field") if match else None)
    if isinstance(exc, CapacityError):
        return unavailable(text)
    if isinstance(exc, Overloaded):
        return APIError(429, text, type="rate_limit_error", code="too_many_requests")
    if isinstance(exc, (DeadlineExceeded, asyncio.TimeoutError)):
        return unavailable(f"the pipeline did not answer in time: {text or 'timeout'}; retry later")
    if isinstance(exc, (TransferError, RequestCancelled, ConfigError, EngineFailed)):
        return unavailable(f"the pipeline could not serve the request: {text}")
    if _is_ray_actor_error(exc):
        return unavailable(f"a pipeline worker is unavailable ({type(exc).__name__}); retry shortly")
    err = internal_error(request_id)
    log.error("internal error serving request %s", request_id, exc_info=exc)
    return err


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def public_text(exc: BaseException) -> str:
    """An error's message fit for a response body: the first line, no colour codes, cut short.

    A Ray task error's text is the whole remote traceback (paths, pid, colour codes); its cause,
    the exception raised on the worker, is what the client is told about.
    """
    text = _ANSI.sub("", str(_cause(exc))).strip()
    line = text.splitlines()[0] if text else ""
    if line.startswith("Traceback") or line.startswith("ray::"):
        return type(exc).__name__
    return line if len(line) <= MAX_MESSAGE_CHARS else line[: MAX_MESSAGE_CHARS - 3] + "..."


def _cause(exc: BaseException) -> BaseException:
    """The exception a worker raised, for one that Ray re-raised here as a RayTaskError."""
    for _ in range(8):  # a chain of remote calls wraps once per hop
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, BaseException) or not _is_ray_error(exc, "RayTaskError"):
            break
        exc = cause
    return exc


def _is_ray_actor_error(exc: BaseException) -> bool:
    return _is_ray_error(exc, "RayActorError", "ActorDiedError")


def _is_ray_error(exc: BaseException, *names: str) -> bool:
    # Checked by name so that this module (and its unit tests) need no Ray import.
    return any(cls.__name__ in names for cls in type(exc).__mro__)
