"""Tensor-parallel sizes and shares, without torch (the coordinator checks sizes with these too)."""

from __future__ import annotations

from typing import Any

from moriio_ray.engine.arch import ModelArgs
from moriio_ray.errors import ConfigError


def check_tp_size(args: ModelArgs, size: object, field: str = "tensor_parallel_size") -> int:
    """``size`` if it shards ``args`` evenly; else ConfigError naming ``field`` and what divides."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"{field}: {size!r} must be a positive integer")
    counts = {
        "attention heads": args.num_heads,
        "KV heads": args.num_kv_heads,
        "intermediate size": args.intermediate_size,
    }
    for what, count in counts.items():
        if count % size:
            ok = [n for n in range(1, args.num_kv_heads + 1) if _divides_all(n, counts.values())]
            raise ConfigError(
                f"{field}: {size} does not divide the model's {count} {what} "
                f"({args.num_heads} attention heads, {args.num_kv_heads} KV heads); "
                f"use one of {', '.join(map(str, ok))}"
            )
    return size


def _divides_all(n: int, counts: Any) -> bool:
    return all(c % n == 0 for c in counts)


def shard_range(total: int, rank: int, size: int) -> range:
    """The contiguous share of ``total`` items (heads, rows) that ``rank`` of ``size`` holds."""
    per = total // size
    return range(rank * per, (rank + 1) * per)
