"""The real ``amd-mori`` 1.2.4 wheel, fetched once with pip into a cache outside the source tree.

The wheel is built for CPython 3.10 on ROCm, so it is downloaded for that target (not installed) and
only read: its Python sources and the pybind module's bytes. The cache directory comes from
``moriio_ray.env.cache_dir()`` (``MORIIO_RAY_CACHE_DIR`` overrides it); a machine without access to
the package index gets ``WheelUnavailable`` with the reason, and the surface tests skip with it.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from moriio_ray import env

VERSION = "1.2.4"
WHEEL_NAME = f"amd_mori-{VERSION}-cp310-cp310-manylinux_2_35_x86_64.whl"
# The file pip fetched when this check was written; a different file under the same name is an error.
WHEEL_SHA256 = "ba60848d9f10fe2de1848d4d4cd5edbae1f7bb3421c3200b66a3c91f52886e02"
PYBIND_MEMBER = "mori/libmori_pybinds.so"
_DOWNLOAD_TIMEOUT_S = 180.0


class WheelUnavailable(RuntimeError):
    """The wheel is not cached and could not be downloaded here (the message says why)."""


def wheel_path() -> Path:
    """The cached wheel, downloading it on first use; raises WheelUnavailable without the index."""
    cached = Path(env.cache_dir()) / f"amd-mori-{VERSION}" / WHEEL_NAME
    if not cached.is_file():
        _download(cached)
    digest = hashlib.sha256(cached.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise AssertionError(
            f"{cached} has sha256 {digest}, not the {WHEEL_SHA256} of the amd-mori {VERSION} wheel this "
            "check was written against; delete it to fetch it again"
        )
    return cached


def _download(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--python-version", "3.10", "--implementation", "cp", "--abi", "cp310"]
        cmd += ["--platform", "manylinux_2_35_x86_64", "--retries", "1", "--timeout", "30"]
        cmd += ["--disable-pip-version-check", "-d", tmp, f"amd-mori=={VERSION}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=_DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise WheelUnavailable(
                f"pip download amd-mori=={VERSION} ran past {_DOWNLOAD_TIMEOUT_S:.0f} s"
            ) from None
        fetched = Path(tmp) / WHEEL_NAME
        if done.returncode != 0 or not fetched.is_file():
            lines = [ln for ln in done.stderr.splitlines() if ln.strip() and "WARNING" not in ln]
            why = lines[-1] if lines else f"exit status {done.returncode}"
            raise WheelUnavailable(f"pip download amd-mori=={VERSION} failed: {why}")
        fetched.replace(target)  # atomic within one directory: a parallel run never sees half a file


def read_sources(wheel: Path, prefix: str = "mori/io/") -> dict[str, str]:
    """The Python files of the wheel under ``prefix`` (``{"mori/io/engine.py": text, ...}``)."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.startswith(prefix) and n.endswith(".py")]
        return {name: archive.read(name).decode() for name in names}


def read_member(wheel: Path, name: str) -> bytes:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(name)
