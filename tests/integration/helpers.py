"""Shared pieces of the Ray integration tests: configs, prompts, polling and leak checks."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable
from typing import Any

from moriio_ray import PDPipeline
from moriio_ray.config import PipelineConfig
from moriio_ray.config_load import parse_pipeline_config

NUM_BLOCKS = 256
BLOCK_SIZE = 16


def tiny_config(
    name: str,
    *,
    backend: str = "shm",
    mode: str = "read",
    prefill: int = 1,
    decode: int = 1,
    colocated: int = 0,
    layout: str = "layer_major",
    transfer: dict[str, Any] | None = None,
    runtime: dict[str, Any] | None = None,
    pool: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
) -> PipelineConfig:
    """A CPU pipeline on the tiny preset; workers take half a CPU so that 2P2D fits in 4."""
    role = {"num_cpus": 0.5}
    data: dict[str, Any] = {
        "name": name,
        "model": {"preset": "tiny", "seed": 0},
        "engine": {
            "device": "cpu",
            "num_blocks": NUM_BLOCKS,
            "block_size": BLOCK_SIZE,
            "layout": layout,
            "max_num_seqs": 32,
            **(engine or {}),
        },
        "transfer": {"backend": backend, "mode": mode, **(transfer or {})},
        "pool": {
            "prefill": {**role, "replicas": prefill},
            "decode": {**role, "replicas": decode},
            "colocated": {**role, "replicas": colocated},
            **(pool or {}),
        },
        "runtime": {"health_check_period_s": 0.25, "remote_timeout_s": 30.0, **(runtime or {})},
    }
    return parse_pipeline_config(data)


def colocated_config(name: str, **kw: Any) -> PipelineConfig:
    return tiny_config(name, prefill=0, decode=0, colocated=1, **kw)


def varied_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts: lengths 1, one block, two blocks, one past a block, then random up to 120."""
    rng = random.Random(seed)
    lengths = [1, BLOCK_SIZE, 2 * BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE - 1]
    lengths += [rng.randint(2, 120) for _ in range(n - len(lengths))]
    return [[rng.randrange(32, 127) for _ in range(length)] for length in lengths[:n]]


def wait_until(pred: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    """Poll ``pred`` until it holds (bounded); fail with ``what`` otherwise."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for: {what}")
        time.sleep(poll_s)


def leaks(stats: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Workers whose blocks are not all free, or that still hold leases or reservations."""
    bad = {}
    for key, w in stats["workers"].items():
        if "error" in w:
            bad[key] = w
        elif (
            w["num_free_blocks"] != w["num_blocks"]
            or w["num_leased_blocks"] != 0
            or w.get("pending_reservations", 0) != 0
        ):
            bad[key] = {k: w[k] for k in ("num_free_blocks", "num_blocks", "num_leased_blocks")}
    return bad


def assert_no_leaks(pipe: Any, timeout_s: float = 10.0) -> None:
    """Every engine's free-block count returns to its start value (fire-and-forget releases land)."""
    last: dict[str, Any] = {}

    def clean() -> bool:
        nonlocal last
        last = leaks(pipe.stats())
        return not last

    try:
        wait_until(clean, timeout_s, "every engine's blocks to be free again")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {last}") from None


class Pipelines:
    """A module's pipelines, shared by its tests: each launched on first use (``config(key)``), shut
    down by the test that uses it last (``close``) or at the module's end (``close_all``). A test
    that kills a worker leaves the pool whole again (it waits for the replacement) before the next
    test gets the pipeline."""

    def __init__(self, config: Callable[[Any], PipelineConfig]) -> None:
        self.config = config
        self.open: dict[Hashable, PDPipeline] = {}

    def get(self, key: Hashable) -> PDPipeline:
        if key not in self.open:
            self.open[key] = PDPipeline.launch(self.config(key))
        return self.open[key]

    def close(self, key: Hashable) -> None:
        pipe = self.open.pop(key, None)
        if pipe is not None:
            pipe.shutdown()

    def close_all(self) -> None:
        for key in list(self.open):
            self.close(key)

    def __enter__(self) -> Pipelines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_all()
