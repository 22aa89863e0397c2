"""The ingress's attach-or-launch rule and build_app's Serve options (no Ray cluster is started)."""

from __future__ import annotations

from typing import Any

import pytest

from moriio_ray.caller import pipeline as pipeline_mod
from moriio_ray.config import PipelineConfig
from moriio_ray.config_load import parse_pipeline_config
from moriio_ray.errors import ConfigError
from moriio_ray.serve import app as app_mod

CFG = parse_pipeline_config({"name": "unit", "serve": {"max_ongoing_requests": 5, "num_replicas": 2}})


class FakePDPipeline:
    """A FAKE PDPipeline class for unit tests: records connect/launch/shutdown instead of using Ray."""

    running: PipelineConfig | None = None
    calls: list[str] = []

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config

    @classmethod
    def connect(cls, name: str) -> FakePDPipeline:
        cls.calls.append(f"connect {name}")
        if cls.running is None or cls.running.name != name:
            raise ConfigError(f"name: no pipeline named {name!r} is running")
        return cls(cls.running)

    @classmethod
    def launch(cls, config: PipelineConfig, *, detached: bool = False) -> FakePDPipeline:
        cls.calls.append(f"launch {config.name} detached={detached}")
        cls.running = config
        return cls(config)

    def shutdown(self) -> None:
        FakePDPipeline.calls.append("shutdown")
        FakePDPipeline.running = None


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> type[FakePDPipeline]:
    FakePDPipeline.running, FakePDPipeline.calls = None, []
    monkeypatch.setattr(pipeline_mod, "PDPipeline", FakePDPipeline)
    return FakePDPipeline


@pytest.mark.timeout(30)
def test_launches_when_none_runs_and_stops_it_on_shutdown(fake: type[FakePDPipeline]) -> None:
    pipe, launched = app_mod.attach_or_launch(CFG)
    assert launched and fake.calls == ["connect unit", "launch unit detached=True"]
    ingress = app_mod.OpenAIIngress.__new__(app_mod.OpenAIIngress)
    ingress.pipe, ingress.launched = pipe, launched
    ingress.__del__()
    assert fake.calls[-1] == "shutdown" and fake.running is None
    ingress.__del__()  # Python calls it again on collection: no second shutdown
    assert fake.calls.count("shutdown") == 1


@pytest.mark.timeout(30)
def test_attaches_to_a_running_pipeline_and_leaves_it_running(fake: type[FakePDPipeline]) -> None:
    fake.running = CFG
    pipe, launched = app_mod.attach_or_launch(CFG)
    assert not launched and fake.calls == ["connect unit"]
    ingress = app_mod.OpenAIIngress.__new__(app_mod.OpenAIIngress)
    ingress.pipe, ingress.launched = pipe, launched
    ingress.__del__()
    assert "shutdown" not in fake.calls and fake.running is CFG


@pytest.mark.timeout(30)
def test_refuses_a_running_pipeline_with_another_config(fake: type[FakePDPipeline]) -> None:
    fake.running = parse_pipeline_config({"name": "unit", "engine": {"block_size": 32}})
    with pytest.raises(ConfigError, match="already runs with another config"):
        app_mod.attach_or_launch(CFG)


@pytest.mark.timeout(30)
def test_attaches_whatever_its_own_serve_section(fake: type[FakePDPipeline]) -> None:
    # the serve section configures one ingress app, not the pool: another app may share the pool
    fake.running = parse_pipeline_config({"name": "unit", "serve": {"stream_interval": 8}})
    pipe, launched = app_mod.attach_or_launch(CFG)
    assert not launched and pipe.config is fake.running


@pytest.mark.timeout(30)
def test_build_app_bounds_serve_queues() -> None:
    application = app_mod.build_app(msgspec_builtins(CFG))
    deployment: Any = application._bound_deployment
    assert deployment.name == "OpenAIIngress"
    assert deployment.num_replicas == 2
    assert deployment.max_ongoing_requests == 5 + app_mod.INGRESS_HEADROOM
    assert deployment.max_queued_requests == 5
    assert parse_pipeline_config(deployment.init_args[0]) == CFG
    with pytest.raises(ConfigError, match="pool"):
        app_mod.build_app({"pool": {"prefill": {"replicas": 0}}})


def msgspec_builtins(cfg: PipelineConfig) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(cfg)
