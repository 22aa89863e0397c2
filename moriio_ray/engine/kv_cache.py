"""The paged KV cache: one tensor in the layer-major or block-major ``KVLayout``, and its per-layer views.

The tensor comes from ``agent.allocate`` when the engine has a transfer agent (so that the backend
can export it: shared memory, IPC, ...) and is registered with it; otherwise it is plain torch memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moriio_ray.config import EngineConfig
from moriio_ray.engine.arch import ModelArgs
from moriio_ray.engine.device import dtype_name
from moriio_ray.errors import ConfigError
from moriio_ray.transfer.layout import LAYER_MAJOR, KVLayout

if TYPE_CHECKING:
    from moriio_ray.transfer.base import MemoryDesc, TransferAgent

DEFAULT_CPU_BLOCKS = 512


def _layout(
    args: ModelArgs,
    config: EngineConfig,
    dtype: torch.dtype,
    num_blocks: int,
    heads: range | None = None,
    total_kv_heads: int = 0,
) -> KVLayout:
    start = heads.start if heads is not None else 0
    return KVLayout(
        num_layers=args.num_layers,
        num_blocks=num_blocks,
        block_size=config.block_size,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        dtype=dtype_name(dtype),
        order=config.layout,
        kv_head_start=start,
        total_kv_heads=total_kv_heads,
    )


def resolve_num_blocks(
    args: ModelArgs, config: EngineConfig, dtype: torch.dtype, device: torch.device
) -> int:
    """``num_blocks`` if set; else 512 on CPU, or ``gpu_memory_fraction`` of the GPU's free memory."""
    if config.num_blocks is not None:
        return config.num_blocks
    if device.type != "cuda":
        return DEFAULT_CPU_BLOCKS
    free_bytes, _ = torch.cuda.mem_get_info(device)
    block_bytes = _layout(args, config, dtype, 1).block_bytes
    num_blocks = int(free_bytes * config.gpu_memory_fraction) // block_bytes
    if num_blocks < 1:
        raise ConfigError(
            f"engine.gpu_memory_fraction: {config.gpu_memory_fraction} of {free_bytes} free bytes holds "
            f"no {block_bytes}-byte KV block; raise it or set engine.num_blocks"
        )
    return num_blocks


class KVCache:
    """The cache tensor, its layout, its registration, and (k, v) views per layer.

    Each view has shape [num_blocks, block_size, kv_heads, head_dim]; in the block-major layout the
    views are strided (a block's layers sit next to each other). ``extra_blocks`` are added beyond
    the configured count (the engine keeps one as scratch for padded CUDA-graph rows). A
    tensor-parallel rank's cache holds its own KV heads: ``args`` is the rank's share of the model,
    ``heads`` the model's heads it holds (``KVLayout.kv_head_start``) out of ``total_kv_heads``.
    """

    def __init__(
        self,
        args: ModelArgs,
        config: EngineConfig,
        dtype: torch.dtype,
        device: torch.device,
        agent: TransferAgent | None = None,
        extra_blocks: int = 0,
        heads: range | None = None,
        total_kv_heads: int = 0,
    ) -> None:
        num_blocks = resolve_num_blocks(args, config, dtype, device) + extra_blocks
        self.layout = _layout(args, config, dtype, num_blocks, heads, total_kv_heads)
        self._agent = agent
        if agent is None:
            self.tensor = torch.zeros(self.layout.shape, dtype=dtype, device=device)
        else:
            self.tensor = _as_cache(agent.allocate(self.layout.shape, dtype, device), self.layout, dtype)
        self.mem: MemoryDesc | None = agent.register(self.tensor) if agent is not None else None
        if self.layout.order == LAYER_MAJOR:  # [layers, 2, blocks, bs, h, d]
            self.layers = [(self.tensor[i, 0], self.tensor[i, 1]) for i in range(args.num_layers)]
        else:  # [blocks, layers, 2, bs, h, d]
            self.layers = [(self.tensor[:, i, 0], self.tensor[:, i, 1]) for i in range(args.num_layers)]

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    def close(self) -> None:
        """Deregister the cache from the agent (the agent itself belongs to the caller)."""
        if self._agent is not None and self.mem is not None:
            self._agent.deregister(self.mem)
            self.mem = None


def _as_cache(raw: torch.Tensor, layout: KVLayout, dtype: torch.dtype) -> torch.Tensor:
    """Accept what a backend allocated: the cache shape itself, or flat bytes of the same size."""
    if raw.dtype == dtype and tuple(raw.shape) == layout.shape:
        return raw
    if raw.is_contiguous() and raw.numel() * raw.element_size() == layout.total_bytes:
        return raw.view(torch.uint8).view(dtype).view(layout.shape)
    raise ConfigError(
        f"transfer agent: allocate returned {tuple(raw.shape)} {raw.dtype}, not a {layout.total_bytes}-byte "
        "contiguous region; the backend must honour the requested shape and dtype"
    )
