"""MORIIO_RAY_CLUSTER_TOKEN: what the launching process reads (the coordinator hands it on)."""

from __future__ import annotations

import pytest

from moriio_ray import env
from moriio_ray.errors import ConfigError


@pytest.mark.timeout(10)
def test_cluster_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MORIIO_RAY_CLUSTER_TOKEN", raising=False)
    assert env.configured_cluster_token() is None
    assert env.cluster_token() == env.cluster_token()  # one token per process when unset
    monkeypatch.setenv("MORIIO_RAY_CLUSTER_TOKEN", "0a" * 32)
    assert env.configured_cluster_token() == bytes([10]) * 32 == env.cluster_token()
    monkeypatch.setenv("MORIIO_RAY_CLUSTER_TOKEN", "not hex")
    with pytest.raises(ConfigError, match="MORIIO_RAY_CLUSTER_TOKEN"):
        env.configured_cluster_token()
