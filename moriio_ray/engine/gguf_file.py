"""Open a GGUF file with the ``gguf`` package and read its metadata as plain Python values.

``gguf.GGUFReader`` memory-maps the file; building its field table takes a few seconds for a
50k-token vocabulary, so one process opens a file once (the engine asks for its architecture, its
weights and its tokenizer) and keeps the reader while the file is unchanged.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from moriio_ray.errors import ConfigError

_STRING, _ARRAY = 8, 9  # gguf.GGUFValueType.STRING, .ARRAY
_MISSING = object()


class GGUFFile:
    """A GGUF file's metadata (``value``) and tensors (``tensor_bytes``), through ``gguf.GGUFReader``.

    Imports no torch: the caller side of a pipeline reads a GGUF file's tokenizer too.
    """

    def __init__(self, path: Path) -> None:
        try:
            from gguf import GGUFReader
        except ImportError:
            raise ConfigError(
                f"model.path: {path} is a GGUF file; reading it needs the pip package gguf "
                "(make install adds it)"
            ) from None
        try:
            # copy-on-write: tensors are writable views of the mapping, so torch.from_numpy needs no copy
            self._reader = GGUFReader(str(path), "c")
        except (ValueError, OSError) as exc:
            raise ConfigError(f"model.path: {path} is not a readable GGUF file: {exc}") from None
        self.path = path
        self._tensors = {t.name: t for t in self._reader.tensors}

    def has(self, key: str) -> bool:
        return key in self._reader.fields

    def value(self, key: str, default: Any = _MISSING) -> Any:
        """A metadata value: int, float, bool or str, or a list of them for an array."""
        field = self._reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ConfigError(f"gguf: {self.path.name} has no metadata key {key!r}")
            return default
        kinds = [int(t) for t in field.types]
        if kinds[0] == _ARRAY:
            if kinds[1] == _STRING:
                return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            if not field.data:
                return []
            return np.concatenate([field.parts[i] for i in field.data]).tolist()
        if kinds[0] == _STRING:
            return bytes(field.parts[field.data[0]]).decode("utf-8")
        return field.parts[field.data[0]][0].item()

    @property
    def architecture(self) -> str:
        return str(self.value("general.architecture"))

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_info(self, name: str) -> tuple[int, tuple[int, ...]]:
        """(GGML type id, shape in numpy order: rows first) of a tensor."""
        tensor = self._tensors[name]
        return int(tensor.tensor_type), tuple(int(d) for d in reversed(tensor.shape.tolist()))

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The tensor's raw data as a flat uint8 array over the file mapping (no copy)."""
        return self._tensors[name].data.reshape(-1).view(np.uint8)


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(Path(path))


def open_gguf(path: Path) -> GGUFFile:
    """The file at ``path``, opened once per process while its size and mtime stay the same."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise ConfigError(f"model.path: cannot read {path}: {exc}") from None
    return _open(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
