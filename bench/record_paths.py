"""How a benchmark record names a file: by its path in the repository, never by this machine's
layout (a file outside the repository is named by its file name alone)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def repo_path(path: str | Path) -> str:
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else resolved.name
