"""Fixtures shared by the e2e modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

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
