"""The workload of ``transfer_gpu_bench.py``: a Llama-3.1-8B-like layer-major cache and its cases.

Both worker processes rebuild the same cases from the same seeds, so only case names cross the
pipes. P's cache holds ``fill_random(P_SEED)``; D checks a result against that pattern, rebuilt on
its own GPU (``P_REF``), block by block.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from moriio_ray.transfer import TransferPlan, plan_blocks
from moriio_ray.transfer.layout import LAYER_MAJOR, KVLayout

# 32 layers, 8 KV heads, head dim 128, bf16, block 16: one (layer, K or V, block) is 32 KiB
LAYOUT_KW = dict(
    num_layers=32, num_blocks=2048, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16"
)
PROMPTS = (128, 1024, 4096, 16384)
CONTIGUOUS_BYTES = 2 << 30
P_SEED, D_SEED, POISON_SEED = 1234, 5678, 91011
GB = 1e9


@dataclasses.dataclass(frozen=True)
class Case:
    """One transfer: D's segments ``d_off`` <- P's segments ``p_off`` (sizes ``sizes``)."""

    name: str
    d_blocks: np.ndarray | None  # None: one contiguous segment at offset 0 of both caches
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

    def ceiling(self) -> Case:
        """The same number of bytes as one contiguous segment (the copy-engine ceiling's shape)."""
        one = np.zeros(1, np.int64)
        return Case(f"{self.name}/contiguous", None, None, one, one.copy(), np.array([self.num_bytes]))


def layout() -> KVLayout:
    return KVLayout(**LAYOUT_KW, order=LAYER_MAJOR)  # type: ignore[arg-type]


@functools.cache
def cases() -> dict[str, Case]:
    """layer_major/{128,1024,4096,16384} (random blocks on both sides) and contiguous/2GiB."""
    lm = layout()
    rng = np.random.default_rng(42)
    out: dict[str, Case] = {}
    for tokens in PROMPTS:
        n = tokens // lm.block_size
        d_blocks = rng.choice(lm.num_blocks, n, replace=False)
        p_blocks = rng.choice(lm.num_blocks, n, replace=False)
        plan: TransferPlan = plan_blocks(d_blocks, p_blocks, lm, lm)  # local = D
        name = f"layer_major/{tokens}"
        out[name] = Case(name, d_blocks, p_blocks, plan.local_offsets, plan.remote_offsets, plan.sizes)
    one = np.zeros(1, np.int64)
    out["contiguous/2GiB"] = Case(
        "contiguous/2GiB", None, None, one, one.copy(), np.array([CONTIGUOUS_BYTES])
    )
    return out


def case(name: str) -> Case:
    if name.endswith("/contiguous"):
        return cases()[name.rsplit("/", 1)[0]].ceiling()
    return cases()[name]


def fill_random(flat: torch.Tensor, seed: int) -> None:
    """Seeded random bytes in a uint8 GPU tensor (the same bytes on any GPU of one model)."""
    gen = torch.Generator(device=flat.device).manual_seed(seed)
    flat.view(torch.int32).random_(generator=gen)


def verify(d_cache: torch.Tensor, p_ref: torch.Tensor, c: Case) -> bool:
    """Whether D's cache holds P's bytes where ``c`` put them (both flat uint8, on D's GPU)."""
    if c.d_blocks is None or c.p_blocks is None:
        n = c.num_bytes
        return bool(torch.equal(d_cache[:n], p_ref[:n]))
    shape = layout().shape
    d5 = d_cache.view(torch.int16).view(shape)
    p5 = p_ref.view(torch.int16).view(shape)
    di = torch.as_tensor(c.d_blocks, device=d_cache.device)
    pi = torch.as_tensor(c.p_blocks, device=d_cache.device)
    return bool(torch.equal(d5.index_select(2, di), p5.index_select(2, pi)))  # dim 2: blocks
