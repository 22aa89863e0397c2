"""GGUF tensor data -> float32 torch tensors: F32, F16, BF16 and the Q8_0, Q4_0, Q4_1 block formats.

The block layouts are ggml's (``ggml-common.h``), 32 weights per block, little-endian:

- ``Q8_0``: 34 bytes = f16 scale ``d``, then 32 int8 ``q``; ``x = d * q``.
- ``Q4_0``: 18 bytes = f16 ``d``, then 16 bytes of nibbles; ``x = d * (q - 8)``.
- ``Q4_1``: 20 bytes = f16 ``d``, f16 minimum ``m``, then 16 bytes of nibbles; ``x = d * q + m``.

In both 4-bit formats byte ``j`` holds weight ``j`` in its low nibble and weight ``j + 16`` in its
high nibble. The arithmetic is float32 and in the order of the reference (``gguf.quants``), so the
results are bit-identical to it. Dequantizing in torch runs on the target device, so a GPU engine
expands its weights there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moriio_ray.errors import ConfigError

BLOCK = 32  # weights per block in every quantized format here

# GGML type id -> (name, bytes per block, weights per block); ids from ggml's `enum ggml_type`
TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 4, 1),
    1: ("F16", 2, 1),
    2: ("Q4_0", 2 + BLOCK // 2, BLOCK),
    3: ("Q4_1", 4 + BLOCK // 2, BLOCK),
    8: ("Q8_0", 2 + BLOCK, BLOCK),
    30: ("BF16", 2, 1),
}


def _f16(raw: torch.Tensor) -> torch.Tensor:
    # raw [n, 2] uint8 -> [n, 1] float32
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    # qs [n, 16] uint8 -> [n, 32] uint8: low nibbles are weights 0..15, high nibbles 16..31
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _f32(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float32)


def _f16_elems(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float16).float()


def _bf16(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.bfloat16).float()  # exact: bfloat16 is float32's top half


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _f16(blocks[:, :2])


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return _f16(blocks[:, :2]) * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 4:]).float()
    return _f16(blocks[:, :2]) * q + _f16(blocks[:, 2:4])


_ELEMENTWISE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F32": _f32,
    "F16": _f16_elems,
    "BF16": _bf16,
}
_BLOCKWISE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1}


def type_info(ggml_type: int, name: str = "") -> tuple[str, int, int]:
    """(type name, bytes per block, weights per block); ConfigError naming the supported types."""
    entry = TYPES.get(int(ggml_type))
    if entry is None:
        try:
            import gguf

            label = gguf.GGMLQuantizationType(int(ggml_type)).name
        except (ImportError, ValueError):
            label = str(ggml_type)
        supported = ", ".join(n for n, _, _ in TYPES.values())
        raise ConfigError(
            f"gguf: tensor {name!r} has type {label}, which is not supported; supported: {supported}"
        )
    return entry


def dequantize(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...], name: str = "") -> torch.Tensor:
    """Float32 tensor of ``shape`` (numpy order: rows first) from the tensor's raw bytes (uint8, 1-D)."""
    kind, block_bytes, block_weights = type_info(ggml_type, name)
    num_weights = 1
    for dim in shape:
        num_weights *= dim
    expected_bytes = num_weights // block_weights * block_bytes
    if num_weights % block_weights or raw.numel() != expected_bytes:
        raise ConfigError(
            f"gguf: tensor {name!r} of type {kind} and shape {shape} needs {expected_bytes} bytes, "
            f"the file holds {raw.numel()}"
        )
    if kind in _ELEMENTWISE:
        return _ELEMENTWISE[kind](raw).reshape(shape)
    blocks = raw.reshape(-1, block_bytes)  # [num_blocks, block_bytes]
    return _BLOCKWISE[kind](blocks).reshape(shape)
