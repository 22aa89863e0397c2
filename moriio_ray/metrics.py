"""Prometheus metrics through ``ray.util.metrics``.

Ray exports them on each node's metrics endpoint (the address is printed by ``ray start`` and listed
by ``ray.nodes()`` as ``MetricsExportPort``), prefixed ``ray_``: e.g. ``ray_moriio_transfer_bytes_total``.
Outside a Ray process every call here is a no-op, so plain ``EngineWorker`` tests need no Ray.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

_LATENCY_BOUNDS_S = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
]  # fmt: skip
_SEGMENT_BOUNDS = [1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0]

_lock = threading.Lock()
_metrics: dict[str, Any] | None = None


def _ray_ready() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def _get() -> dict[str, Any] | None:
    global _metrics
    if _metrics is not None:
        return _metrics
    if not _ray_ready():
        return None
    with _lock:
        if _metrics is None:
            from ray.util import metrics as m

            tags = ("backend", "role")
            _metrics = {
                "transfer_bytes": m.Counter(
                    "moriio_transfer_bytes", "KV bytes moved between engines", tag_keys=tags
                ),
                "transfer_seconds": m.Histogram(
                    "moriio_transfer_seconds",
                    "Time of one KV transfer, issue to completion",
                    boundaries=_LATENCY_BOUNDS_S,
                    tag_keys=tags,
                ),
                "transfer_segments": m.Histogram(
                    "moriio_transfer_segments",
                    "Segments in one KV transfer (after coalescing)",
                    boundaries=_SEGMENT_BOUNDS,
                    tag_keys=tags,
                ),
                "failures": m.Counter("moriio_failures", "Failures by kind", tag_keys=("kind", "role")),
                "handoff_seconds": m.Histogram(
                    "moriio_handoff_seconds",
                    "Prefill done to the first decode step, minus the raw transfer time",
                    boundaries=_LATENCY_BOUNDS_S,
                    tag_keys=("backend", "mode"),
                ),
                "ttft_seconds": m.Histogram(
                    "moriio_ttft_seconds",
                    "Time to first token",
                    boundaries=_LATENCY_BOUNDS_S,
                    tag_keys=("mode",),
                ),
                "tpot_seconds": m.Histogram(
                    "moriio_tpot_seconds",
                    "Time per output token after the first, one observation per request",
                    boundaries=_LATENCY_BOUNDS_S,
                    tag_keys=("mode",),
                ),
                "free_blocks": m.Gauge(
                    "moriio_free_blocks", "Free KV blocks of one engine", tag_keys=("worker", "role")
                ),
                "leased_blocks": m.Gauge(
                    "moriio_leased_blocks", "Leased KV blocks of one engine", tag_keys=("worker", "role")
                ),
                "prefix_hit_rate": m.Gauge(
                    "moriio_prefix_cache_hit_rate",
                    "Prompt tokens found in one engine's prefix cache, over those looked up",
                    tag_keys=("worker", "role"),
                ),
                "prefix_cached_blocks": m.Gauge(
                    "moriio_prefix_cache_blocks",
                    "KV blocks one engine's prefix cache holds (in use or parked)",
                    tag_keys=("worker", "role"),
                ),
            }
    return _metrics


def record_transfer(num_bytes: int, seconds: float, num_segments: int, *, backend: str, role: str) -> None:
    m = _get()
    if m is None:
        return
    tags = {"backend": backend, "role": role}
    m["transfer_bytes"].inc(num_bytes, tags=tags)
    m["transfer_seconds"].observe(seconds, tags=tags)
    m["transfer_segments"].observe(num_segments, tags=tags)


def record_failure(kind: str, *, role: str) -> None:
    m = _get()
    if m is not None:
        m["failures"].inc(1, tags={"kind": kind, "role": role})


def record_handoff(seconds: float, *, backend: str, mode: str) -> None:
    m = _get()
    if m is not None:
        m["handoff_seconds"].observe(max(seconds, 0.0), tags={"backend": backend, "mode": mode})


def record_ttft(seconds: float, *, mode: str) -> None:
    m = _get()
    if m is not None:
        m["ttft_seconds"].observe(seconds, tags={"mode": mode})


def record_tpot(seconds: float, *, mode: str) -> None:
    """One request's time per output token after the first (observed once, when it finishes)."""
    m = _get()
    if m is not None:
        m["tpot_seconds"].observe(seconds, tags={"mode": mode})


def set_blocks(free: int, leased: int, *, worker: str, role: str) -> None:
    m = _get()
    if m is None:
        return
    tags = {"worker": worker, "role": role}
    m["free_blocks"].set(free, tags=tags)
    m["leased_blocks"].set(leased, tags=tags)


def set_prefix_cache(
    hit_tokens: int, queried_tokens: int, cached_blocks: int, *, worker: str, role: str
) -> None:
    m = _get()
    if m is None:
        return
    tags = {"worker": worker, "role": role}
    m["prefix_hit_rate"].set(hit_tokens / queried_tokens if queried_tokens else 0.0, tags=tags)
    m["prefix_cached_blocks"].set(cached_blocks, tags=tags)
