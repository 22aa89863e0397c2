"""Where this process runs: the node IP and node id that descriptors carry (Ray's when inside Ray)."""

from __future__ import annotations

import socket
import sys
from functools import lru_cache


def _ray() -> object | None:
    # Only ask Ray when the process already uses it: importing ray here would be heavy.
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        return ray
    return None


def node_ip() -> str:
    """Ray's node IP inside a Ray process, else the loopback address."""
    ray = _ray()
    if ray is not None:
        return str(ray.util.get_node_ip_address())  # type: ignore[attr-defined]
    return "127.0.0.1"


def node_id() -> str:
    """Ray's node id inside a Ray process, else the host name."""
    ray = _ray()
    if ray is not None:
        return str(ray.get_runtime_context().get_node_id())  # type: ignore[attr-defined]
    return _hostname()


@lru_cache(maxsize=1)
def _hostname() -> str:
    return socket.gethostname()


@lru_cache(maxsize=1)
def machine_id() -> str:
    """This machine's identity, the same inside and outside Ray: host name plus boot id.

    Same-host backends compare it (an IP differs between a Ray process, which reports the node IP,
    and a plain process, which reports loopback, on the very same machine).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{_hostname()}/{boot}"
