"""The Ray calls one request makes, per pool mode, measured on a live ``serve run`` (tests/request_trace.py).

Each mode starts its own private ``serve run`` of a config derived from configs/tiny_1p1d_cpu.yaml
with the profile hook in every process, sends three warm-ups, then one streamed request of 8 tokens
in a recording window and an idle window of the same length. The trace runs once per mode and both
tests of that mode read it.

``BEFORE`` is what the request path cost before the caller made one call per request; ``GOAL`` is
the bound now (READ: the caller's call to P and P's hand-over to D; WRITE: plus P's reservation on D).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.request_trace import run_mode

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_1p1d_cpu.yaml"
MODES = ("read", "write")  # colocated (one call, unchanged): python -m tests.request_trace
BEFORE = {"read": 4, "write": 4, "colocated": 1}
GOAL = {"read": 2, "write": 3, "colocated": 1}
SERVING_KINDS = {
    "read": ("ingress", "prefill", "decode"),
    "write": ("ingress", "prefill", "decode"),
    "colocated": ("ingress", "colocated"),
}


class Traces:
    """One trace per mode, run by the first test that asks for it (a failed run is not repeated)."""

    def __init__(self) -> None:
        self._done: dict[str, dict[str, Any] | BaseException] = {}

    def get(self, mode: str) -> dict[str, Any]:
        if mode not in self._done:
            try:
                self._done[mode] = run_mode(CONFIG, mode, concurrency=0, start_timeout_s=200.0)
            except Exception as exc:
                self._done[mode] = exc
        found = self._done[mode]
        if isinstance(found, BaseException):
            raise AssertionError(f"the {mode} trace did not run: {found!r}") from found
        return found


@pytest.fixture(scope="module")
def traces() -> Traces:
    return Traces()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODES)
def test_trace_sees_the_request(traces: Traces, mode: str) -> None:
    """The hook saw every serving process run project code for the request, the idle window took
    background work out, and the request costs no more Ray calls than before."""
    report = traces.get(mode)
    assert not report["warnings"], report["warnings"]
    one = report["one_request"]
    for kind in SERVING_KINDS[mode]:
        assert one["per_kind"].get(kind, 0) > 0, (kind, one["per_kind"])
    assert one["idle_functions"] > 0, "the idle window recorded nothing: the subtraction did nothing"
    assert one["functions"] > 0 and one["files"] > 0
    calls = one["ray_calls"]
    assert calls["total"] <= BEFORE[mode], calls
    assert calls["from_caller"] >= 1, calls
    assert one["output_items"] >= 1, one


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODES)
def test_ray_calls_per_request(traces: Traces, mode: str) -> None:
    """One call from the caller per request; the workers forward the rest."""
    calls = traces.get(mode)["one_request"]["ray_calls"]
    assert calls["total"] <= GOAL[mode], calls["by_method"]
    assert calls["from_caller"] == 1, calls["by_method"]
