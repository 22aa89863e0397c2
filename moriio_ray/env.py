"""The only reader of os.environ. Process-level knobs only; transfer and engine settings live in config."""

from __future__ import annotations

import os
import secrets

_PROCESS_TOKEN = secrets.token_bytes(32)


def log_level() -> str:
    """MORIIO_RAY_LOG_LEVEL (default INFO)."""
    return os.environ.get("MORIIO_RAY_LOG_LEVEL", "INFO").upper()


def configured_cluster_token() -> bytes | None:
    """MORIIO_RAY_CLUSTER_TOKEN (hex) as bytes, or None when it is unset or empty.

    The coordinator's launcher reads it, and the coordinator hands it to every worker; without it
    the coordinator draws a fresh token. ConfigError when it is not an even number of hex digits.
    """
    value = os.environ.get("MORIIO_RAY_CLUSTER_TOKEN", "").strip()
    if not value:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        from moriio_ray.errors import ConfigError

        raise ConfigError(
            "MORIIO_RAY_CLUSTER_TOKEN: expected an even number of hex digits (`openssl rand -hex 32`)"
        ) from None


def cluster_token() -> bytes:
    """The shared token that tcp servers require of an agent made without an explicit one.

    MORIIO_RAY_CLUSTER_TOKEN when set; otherwise one random token per process, so that agents in
    one process (tests, benchmarks) agree. Across processes the coordinator hands the token to
    every worker explicitly.
    """
    token = configured_cluster_token()
    return token if token is not None else _PROCESS_TOKEN


def cuda_visible_devices() -> str | None:
    """CUDA_VISIBLE_DEVICES as the process sees it (None when unset)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def cache_dir() -> str:
    """Where downloads that tests reuse are kept: MORIIO_RAY_CACHE_DIR, else $XDG_CACHE_HOME/moriio-ray,
    else ~/.cache/moriio-ray (outside the source tree, so a clean checkout fetches once per machine)."""
    explicit = os.environ.get("MORIIO_RAY_CACHE_DIR", "")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME", "") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moriio-ray")


def get(name: str, default: str = "") -> str:
    """Read any variable (kept here so that env access stays in one module)."""
    return os.environ.get(name, default)
