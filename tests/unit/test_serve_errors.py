"""Typed errors -> HTTP status, and the admission bound."""

from __future__ import annotations

import asyncio
import gc

import pytest
import ray.exceptions  # the exception classes only: no Ray is started

from moriio_ray.errors import (
    CapacityError,
    DeadlineExceeded,
    InvalidRequest,
    Overloaded,
    PeerLost,
    TransferTimeout,
)
from moriio_ray.serve.admission import Admission
from moriio_ray.serve.errors import APIError, from_exception


def _task_error(cause: Exception) -> Exception:
    """What an await on a worker's call raises when the worker raised ``cause``."""
    return ray.exceptions.RayTaskError(
        "fn", "Traceback (most recent call last): ...", cause
    ).as_instanceof_cause()


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("exc", "validating", "status"),
    [
        (InvalidRequest("temperature: -1 must be >= 0"), True, 400),
        (CapacityError("prompt too long"), True, 400),
        (CapacityError("no live decode worker"), False, 503),
        (Overloaded("busy"), False, 429),
        (DeadlineExceeded("prefill"), False, 503),
        (asyncio.TimeoutError(), False, 503),
        (PeerLost("gone"), False, 503),
        (TransferTimeout("slow"), False, 503),
        (ray.exceptions.RayActorError(), False, 503),
        (ray.exceptions.ActorDiedError(), False, 503),
        (ray.exceptions.ActorUnavailableError("restarting", None), False, 503),
        (_task_error(PeerLost("gone")), False, 503),
        (_task_error(InvalidRequest("top_k: 999 is out of range")), True, 400),
        (_task_error(RuntimeError("bug")), False, 500),
        (RuntimeError("bug"), False, 500),
    ],
)
def test_status_mapping(exc: Exception, validating: bool, status: int) -> None:
    err = from_exception(exc, validating=validating)
    assert err.status == status
    want_type = {400: "invalid_request_error", 429: "rate_limit_error"}.get(status, "server_error")
    assert err.info.type == want_type


@pytest.mark.timeout(10)
def test_invalid_request_names_its_field() -> None:
    err = from_exception(InvalidRequest("top_p: 0 must be in (0, 1]"), validating=True)
    assert err.info.param == "top_p"
    same = APIError(418, "teapot")
    assert from_exception(same, validating=False) is same


@pytest.mark.timeout(10)
def test_admission_bound_and_idempotent_release() -> None:
    adm = Admission(2)
    a, b = adm.acquire(), adm.acquire()
    with pytest.raises(APIError) as info:
        adm.acquire()
    assert info.value.status == 429 and adm.rejected == 1
    a.release()
    a.release()  # twice is harmless
    assert adm.in_flight == 1
    c = adm.acquire()
    assert adm.in_flight == 2 and c.held
    b.release()
    c.release()
    assert adm.stats() == {"limit": 2, "in_flight": 0, "admitted": 3, "rejected": 1}


@pytest.mark.timeout(10)
def test_a_dropped_slot_releases_itself() -> None:
    adm = Admission(1)
    slot = adm.acquire()
    assert adm.in_flight == 1
    del slot
    gc.collect()
    assert adm.in_flight == 0


@pytest.mark.timeout(10)
def test_admission_rejects_a_zero_limit() -> None:
    with pytest.raises(ValueError):
        Admission(0)
