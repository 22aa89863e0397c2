"""The control-plane simulation (bench/control_plane.py), bounded at N = 64: the real coordinator,
routers and membership code over 64 simulated engines and 16 callers. It checks what must hold at
any N (every change reaches every caller and every engine, a crash and a hang are both found and
replaced, a scale-up reaches everyone, the membership travels as deltas); the bench measures how
fast."""

from __future__ import annotations

import asyncio

import pytest

from bench.control_plane import Run, parse_args
from bench.control_plane_report import fits

pytestmark = [pytest.mark.usefixtures("ray_cpu"), pytest.mark.timeout(300)]

N = 64
CALLERS = 16


def test_the_control_plane_at_64_engines() -> None:
    args = parse_args(
        [
            *("--callers", str(CALLERS), "--caller-hosts", "2", "--hosts", "2", "--rate", "200"),
            *("--warmup-s", "1", "--window-s", "2", "--scale-up", "4"),
        ]
    )
    r = asyncio.run(Run(N, args)())
    recipients = N - 1 + CALLERS  # everyone but the engine that changed
    for how in ("crashed", "hung"):
        death = r[f"death_{how}"]
        assert death["detect_s"] is not None, f"the {how} engine was never declared dead"
        assert death["down"]["recipients"] == recipients, f"the {how} engine's death did not reach everyone"
        assert death["replacement"]["recipients"] == recipients, f"the {how} engine's replacement did not"
    assert r["scale_up"]["recipients"] == recipients + args.scale_up
    assert r["routed_per_s"] > 0 and r["router_us"]["p50"] is not None
    # a change is a few hundred bytes; the whole membership grows with the pool
    assert 0 < r["membership_change_bytes"] < r["membership_bytes"] / 8
    assert r["descriptor_total_bytes"] == r["descriptor_bytes"] * N
    assert r["coordinator_imports_torch"] is False
    assert r["coordinator_cpu"] > 0 and r["ping_ms"]["p50"] is not None


def test_the_fit_tells_linear_from_quadratic_growth() -> None:
    results = [
        {"n": n, "coordinator_cpu": 1e-3 * n, "router_alone_us": {"p50": 1e-4 * n * n}}
        for n in (128, 512, 1000)
    ]
    f = fits(results)
    assert f["coordinator CPU"]["exponent"] == pytest.approx(1.0)
    assert f["router per request (alone)"]["exponent"] == pytest.approx(2.0)
    assert f["coordinator CPU"]["per_engine"] == pytest.approx(1e-3)
