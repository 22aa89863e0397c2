"""The Serve modes' controller options, and a Serve config document set to a mode or given free ports."""

from __future__ import annotations

import itertools

import pytest
from ray.serve.schema import ServeDeploySchema

from moriio_ray.serve.serve_mode import (
    FAST_ENV,
    controller_env,
    controller_options,
    isolated,
    mode_of,
    with_mode,
)

DOC = {"applications": [{"import_path": "serve_apps.pd_openai:app", "args": {}}]}


@pytest.mark.timeout(10)
def test_controller_options_per_mode() -> None:
    assert controller_options("default") is None
    assert controller_options("fast") == {"runtime_env": {"env_vars": FAST_ENV}}
    assert FAST_ENV == {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_LOG_TO_STDERR": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5",
    }
    assert controller_options("default", {"X": "1"}) == {"runtime_env": {"env_vars": {"X": "1"}}}
    with pytest.raises(ValueError, match="'turbo' is not one of default, fast"):
        controller_options("turbo")


@pytest.mark.timeout(10)
def test_with_mode_switches_a_document_and_keeps_other_variables() -> None:
    fast = with_mode(DOC, "fast")
    assert mode_of(fast) == "fast" and mode_of(DOC) == "default" and "controller_options" not in DOC
    ServeDeploySchema.model_validate(fast)  # Ray's own schema takes it
    custom = {**fast, "controller_options": {"runtime_env": {"env_vars": {**FAST_ENV, "X": "1"}}}}
    assert controller_env(with_mode(custom, "default")) == {"X": "1"}
    assert controller_env(with_mode(with_mode(custom, "default"), "fast")) == {**FAST_ENV, "X": "1"}
    assert "controller_options" not in with_mode(fast, "default")
    half = {**DOC, "controller_options": {"runtime_env": {"env_vars": {"RAY_SERVE_ENABLE_HA_PROXY": "1"}}}}
    assert mode_of(half) == "default"  # both flags, or it is not the measured fast mode


@pytest.mark.timeout(10)
def test_isolated_gives_haproxy_free_ports_in_fast_mode_only() -> None:
    ports = itertools.count(40001)
    fast = isolated(with_mode(DOC, "fast"), lambda: next(ports))
    assert controller_env(fast) == {
        **FAST_ENV,
        "RAY_SERVE_HAPROXY_STATS_PORT": "40001",
        "RAY_SERVE_HAPROXY_METRICS_PORT": "40002",
        # the fallback proxy and the replicas' direct ports are the cluster's own too: another
        # cluster's would share a port with SO_REUSEPORT and take this one's connections
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": "40003",
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": "40004",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "40005",
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "40021",
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": "40006",
        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": "40022",
    }
    ServeDeploySchema.model_validate(fast)
    chosen = with_mode(DOC, "fast")
    chosen["controller_options"]["runtime_env"]["env_vars"]["RAY_SERVE_HAPROXY_STATS_PORT"] = "9999"
    env = controller_env(isolated(chosen, lambda: next(ports)))
    assert env["RAY_SERVE_HAPROXY_STATS_PORT"] == "9999" and env["RAY_SERVE_HAPROXY_METRICS_PORT"] == "40007"
    assert isolated(DOC, lambda: next(ports)) is DOC  # the default mode runs no HAProxy


@pytest.mark.timeout(10)
def test_isolated_puts_haproxys_files_in_the_given_dir() -> None:
    env = controller_env(isolated(with_mode(DOC, "fast"), lambda: 1, "/tmp/x/haproxy/"))
    assert env["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"] == "/tmp/x/haproxy/haproxy.cfg"
    assert env["RAY_SERVE_HAPROXY_SOCKET_PATH"] == "/tmp/x/haproxy/admin.sock"
    assert env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"] == "/tmp/x/haproxy"
    assert env["RAY_SERVE_HAPROXY_SERVER_STATE_FILE"] == "/tmp/x/haproxy/server-state"
    assert env["RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH"] == "/tmp/x/haproxy/metrics.sock"

    with pytest.raises(ValueError, match="longer than 27 characters"):
        isolated(with_mode(DOC, "fast"), lambda: 1, "/tmp/" + "x" * 30)
