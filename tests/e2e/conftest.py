"""Fixtures shared by the e2e modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from bench.launch import ServeProcess
from tests.e2e.serving import Shared

TINY_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_1p1d_cpu.yaml"
# Ray's metrics agent exports every 2 s, not every 10 s: the metrics test waits for one export
FAST_METRICS = {"RAY_metrics_report_interval_ms": "2000"}
# Modules that start servers of their own run after the users of the shared server: its last user
# (test_serve_e2e, whose clean-shutdown test stops it) ends it before them, so that no idle
# cluster (a tenth of the 2 cores) runs beside them.
RUN_LAST = ("test_multinode_docs.py", "test_request_trace.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    places = [i for i, item in enumerate(items) if item.path.parent == here]
    ordered = sorted((items[i] for i in places), key=lambda item: item.path.name in RUN_LAST)  # stable
    for i, item in zip(places, ordered, strict=True):
        items[i] = item


@pytest.fixture(scope="session")
def tiny_serve() -> Iterator[Shared]:
    """``serve run configs/tiny_1p1d_cpu.yaml``, shared by the modules that drive it."""
    shared = Shared(TINY_CONFIG, env=FAST_METRICS)
    try:
        yield shared
    finally:
        shared.close()


@pytest.fixture(scope="module")
def http(server: ServeProcess) -> Iterator[httpx.Client]:
    """An HTTP client on the module's ``server`` fixture."""
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    """The official client on the module's ``server`` fixture."""
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
