"""Device and dtype resolution for the engine (``auto`` means CUDA + bfloat16 when a GPU is visible),
the host-to-device moves of step inputs, and what a launched step's completion offers."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from moriio_ray.errors import ConfigError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``auto`` -> the current CUDA device if there is one, else CPU; ``cuda`` fails clearly without one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("engine.device: 'cuda' was asked for but no CUDA device is visible; use cpu")
        return torch.device("cuda", torch.cuda.current_device())
    if name == "cpu":
        return torch.device("cpu")
    raise ConfigError(f"engine.device: {name!r} is not one of auto, cpu, cuda")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on GPU and float32 on CPU; otherwise the named dtype."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise ConfigError(f"model.dtype: {name!r} is not one of auto, {', '.join(_DTYPES)}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The KVLayout name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` on ``device`` without a host synchronisation (through pinned memory on CUDA, which
    the caching host allocator keeps until the copy has run; on the CPU the array itself, uncopied)."""
    host = torch.from_numpy(array)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def device_tokens(ids: torch.Tensor, src: torch.Tensor, prev_tokens: torch.Tensor | None) -> torch.Tensor:
    """ids [N] with entry i replaced by prev_tokens[src[i]] where src[i] >= 0 (on the device: the
    previous step's samples feed the next step without a trip through the host)."""
    assert prev_tokens is not None, "a token from the device, but no previous step's tokens"
    return torch.where(src >= 0, prev_tokens[src.clamp(min=0)], ids)


class Completion(Protocol):
    """The end of work launched on a device: a ``torch.cuda.Event``, or a simulated step's
    (``sim_model.SimEvent``)."""

    def synchronize(self) -> None:
        """Block the calling thread until the work has run."""
