"""OpenAI-shaped HTTP errors, and the mapping from this package's typed errors to them.

Every error the front end answers has the body ``{"error": {"message", "type", "param", "code"}}``.
Malformed input is always a 4xx; a 5xx means the pipeline itself failed or is unavailable.
"""

from __future__ import annotations

import asyncio
import re

import msgspec

from moriio_ray.errors import (
    CapacityError,
    ConfigError,
    DeadlineExceeded,
    InvalidRequest,
    Overloaded,
    RequestCancelled,
    TransferError,
)


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


def from_exception(exc: BaseException, *, validating: bool) -> APIError:
    """The APIError for an exception raised while serving a request.

    ``validating`` is True while the request is being checked and tokenized (before any engine
    work): a CapacityError there means the prompt cannot fit (400); later it means that no worker
    could take the request (503).
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequest):
        match = _FIELD_PREFIX.match(str(exc))
        return bad_request(str(exc), param=match.group("field") if match else None)
    if isinstance(exc, CapacityError):
        if validating:
            return bad_request(str(exc), param="max_tokens", code="context_length_exceeded")
        return unavailable(str(exc))
    if isinstance(exc, Overloaded):
        return APIError(429, str(exc), type="rate_limit_error", code="too_many_requests")
    if isinstance(exc, (DeadlineExceeded, asyncio.TimeoutError)):
        return unavailable(f"the pipeline did not answer in time: {exc or 'timeout'}; retry later")
    if isinstance(exc, (TransferError, RequestCancelled, ConfigError)):
        return unavailable(f"the pipeline could not serve the request: {exc}")
    if _is_ray_actor_error(exc):
        return unavailable(f"a pipeline worker is unavailable ({type(exc).__name__}); retry shortly")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error", code="internal")


def _is_ray_actor_error(exc: BaseException) -> bool:
    # Checked by name so that this module (and its unit tests) need no Ray import.
    return any(cls.__name__ in ("RayActorError", "ActorDiedError") for cls in type(exc).__mro__)
