"""The GPU transfer bench's cases: KV layouts and prompt lengths as segment lists, and contiguous copies."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import torch

LAYOUT_KW = dict(
    num_layers=32, num_blocks=2048, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16"
)


PROMPTS = (128, 1024, 4096, 16384)


@dataclasses.dataclass(frozen=True)
class Case:
    """One transfer: D's segments ``d_off`` <- P's ``p_off`` (``sizes``); no blocks: contiguous."""

    name: str
    d_blocks: np.ndarray | None
    p_blocks: np.ndarray | None
    d_off: np.ndarray
    p_off: np.ndarray
    sizes: np.ndarray

    @property
    def num_bytes(self) -> int:
        return int(self.sizes.sum())

    @property
    def num_segments(self) -> int:
        return int(self.sizes.size)


def layout() -> Any:
    from moriio_ray.transfer.layout import LAYER_MAJOR, KVLayout

    return KVLayout(**LAYOUT_KW, order=LAYER_MAJOR)  # type: ignore[arg-type]


def contiguous(name: str, num_bytes: int) -> Case:
    one = np.zeros(1, np.int64)
    return Case(name, None, None, one, one.copy(), np.array([num_bytes]))


@functools.cache
def cases() -> dict[str, Case]:
    """layer_major/{128,1024,4096,16384} (random blocks on both sides) and contiguous/2GiB."""
    from moriio_ray import plan_blocks

    lm, rng, out = layout(), np.random.default_rng(42), {}
    for tokens in PROMPTS:
        d_blocks, p_blocks = (rng.choice(lm.num_blocks, tokens // lm.block_size, replace=False) for _ in "dp")
        plan = plan_blocks(d_blocks, p_blocks, lm, lm)  # local = D
        name = f"layer_major/{tokens}"
        out[name] = Case(name, d_blocks, p_blocks, plan.local_offsets, plan.remote_offsets, plan.sizes)
    out["contiguous/2GiB"] = contiguous("contiguous/2GiB", 2 << 30)
    return out


def case(name: str) -> Case:
    """A case by name; ``<case>/contiguous``: its bytes as one segment (the copy-engine ceiling)."""
    if name.endswith("/contiguous"):
        return contiguous(name, cases()[name.rsplit("/", 1)[0]].num_bytes)
    return cases()[name]


def fill_random(flat: torch.Tensor, seed: int) -> None:
    """Seeded random bytes in a uint8 GPU tensor (the same bytes on any GPU of one model)."""
    flat.view(torch.int32).random_(generator=torch.Generator(device=flat.device).manual_seed(seed))
