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


@pytest.fixture(scope="session")
def tiny_serve() -> Iterator[Shared]:
    """``serve run configs/tiny_1p1d_cpu.yaml``, shared by the modules that drive it."""
    shared = Shared(TINY_CONFIG)
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
