"""KVLayout: where each (layer, K/V, block) segment of a paged cache lives, in bytes."""

from __future__ import annotations

import msgspec
import numpy as np

from moriio_ray.errors import ConfigError

LAYER_MAJOR = "layer_major"  # [layers][2][blocks][block_size][heads][dim]
BLOCK_MAJOR = "block_major"  # [blocks][layers][2][block_size][heads][dim]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "uint8": 1}


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """A paged KV cache's geometry. One segment is one block of K (or V) of one layer.

    A tensor-parallel rank's cache holds ``num_kv_heads`` of the model's ``total_kv_heads``,
    starting at head ``kv_head_start`` (``heads``); an unsharded cache holds them all.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int  # heads this cache holds
    head_dim: int
    dtype: str = "bfloat16"
    order: str = LAYER_MAJOR
    kv_head_start: int = 0  # the model's index of this cache's first KV head
    total_kv_heads: int = 0  # the model's KV heads; 0: num_kv_heads (an unsharded cache)

    def __post_init__(self) -> None:
        if self.order not in (LAYER_MAJOR, BLOCK_MAJOR):
            raise ConfigError(f"order: {self.order!r} is not one of {LAYER_MAJOR}, {BLOCK_MAJOR}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype: {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: {getattr(self, name)!r} must be >= 1")
        if self.kv_head_start < 0 or self.heads.stop > self.model_kv_heads:
            raise ConfigError(
                f"kv_head_start: heads {self.heads.start}..{self.heads.stop - 1} do not fit in the "
                f"model's {self.model_kv_heads} KV heads"
            )

    @property
    def model_kv_heads(self) -> int:
        """The model's KV heads (all ranks together)."""
        return self.total_kv_heads or self.num_kv_heads

    @property
    def heads(self) -> range:
        """The model's KV heads this cache holds."""
        return range(self.kv_head_start, self.kv_head_start + self.num_kv_heads)

    @property
    def head_bytes(self) -> int:
        """One head of one token of K (or V)."""
        return self.head_dim * self.elem_bytes

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def segment_bytes(self) -> int:
        """One block of K (or V) of one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.elem_bytes

    @property
    def block_bytes(self) -> int:
        """One block over all layers, K and V."""
        return self.segment_bytes * 2 * self.num_layers

    @property
    def total_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

    @property
    def shape(self) -> tuple[int, ...]:
        """The cache tensor's shape in elements of ``dtype``."""
        tail = (self.block_size, self.num_kv_heads, self.head_dim)
        if self.order == LAYER_MAJOR:
            return (self.num_layers, 2, self.num_blocks, *tail)
        return (self.num_blocks, self.num_layers, 2, *tail)

    def segment_offsets(self, layers: np.ndarray, kv: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Byte offsets of segments (broadcasting int64 arrays of layer, 0/1 for K/V, block id)."""
        if self.order == LAYER_MAJOR:
            index = (layers * 2 + kv) * self.num_blocks + blocks
        else:
            index = (blocks * self.num_layers + layers) * 2 + kv
        return index.astype(np.int64) * self.segment_bytes

    def check_blocks(self, blocks: np.ndarray, what: str) -> None:
        if blocks.size and (int(blocks.min()) < 0 or int(blocks.max()) >= self.num_blocks):
            bad = int(blocks[(blocks < 0) | (blocks >= self.num_blocks)][0])
            raise ConfigError(f"{what}: block id {bad} is outside 0..{self.num_blocks - 1}")
