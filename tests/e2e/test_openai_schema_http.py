"""Every reply kind of the real ``serve run configs/tiny_1p1d_cpu.yaml``, over HTTP, validates against
OpenAI's published schemas (tests/openai_spec.py), and so does every error body it answers.

The kinds and errors are tests/openai_replies.py's; tests/unit/test_openai_schema_handler.py sends
the same ones to the handler over a fake pipeline, plus the errors this server reaches only under
load or failure (429, 503, 500, an error mid-stream). The server is the session's shared one
(tests/e2e/conftest.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from bench.launch import ServeProcess
from tests.e2e.serving import Shared
from tests.openai_replies import ERRORS, KINDS, ErrorCase, Kind, check_error, check_reply

JSON = {"Content-Type": "application/json"}
# The first test to run may start the shared server (tens of seconds on 2 busy cores); each request
# is bounded by the client's 60 s.
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def http(tiny_serve: Shared) -> Iterator[httpx.Client]:
    server: ServeProcess = tiny_serve.get()
    with httpx.Client(base_url=server.base_url, timeout=60, headers=JSON) as client:
        yield client


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_reply_validates(http: httpx.Client, kind: Kind) -> None:
    resp = http.request(kind.method, kind.path, content=kind.body)
    check_reply(kind, resp.status_code, resp.content)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("case", ERRORS, ids=[c.name for c in ERRORS])
def test_error_validates(http: httpx.Client, case: ErrorCase) -> None:
    resp = http.request(case.method, case.path, content=case.body)
    check_error(case, resp.status_code, resp.content)
