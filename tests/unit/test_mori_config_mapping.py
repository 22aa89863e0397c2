"""Our ``transfer.mori`` config -> MoRI's engine and backend configs, through a FAKE ``mori``.

The fake (``tests/unit/fake_mori.py``) stands in for ``mori.io`` because there is no AMD hardware
here and the real ``amd-mori`` wheels are cp310/ROCm only.
"""

from __future__ import annotations

import os

import fake_mori  # tests/unit is on sys.path under pytest (no __init__.py here)
import pytest

from moriio_ray.config import MoriConfig, TransferConfig
from moriio_ray.config_load import parse_pipeline_config
from moriio_ray.errors import ConfigError
from moriio_ray.transfer.mori_api import mori_engine_key


@pytest.fixture
def fabric(monkeypatch):
    return fake_mori.install(monkeypatch)


def _created_backend(fabric, agent):
    (args,) = fabric.methods(agent.mori_key, "create_backend")
    return args


@pytest.mark.timeout(10)
def test_rdma_config_carries_every_knob(fabric):
    agent = fake_mori.make_agent(
        "p0", qp_per_transfer=4, post_batch_size=32, num_workers=3, poll_cq_mode="EVENT"
    )
    backend, cfg = _created_backend(fabric, agent)
    assert backend is fake_mori.BackendType.RDMA
    assert isinstance(cfg, fake_mori.RdmaBackendConfig)
    assert (cfg.qp_per_transfer, cfg.post_batch_size, cfg.num_worker_threads) == (4, 32, 3)
    assert cfg.poll_cq_mode is fake_mori.PollCqMode.EVENT
    assert cfg.enable_notification is False


@pytest.mark.timeout(10)
def test_rdma_defaults_match_moriio_and_turn_notifications_off(fabric):
    _, cfg = _created_backend(fabric, fake_mori.make_agent("p0"))
    # vLLM MoRIIO defaults: qp_per_transfer 1, post_batch_size -1, num_workers 1, POLLING.
    assert (cfg.qp_per_transfer, cfg.post_batch_size, cfg.num_worker_threads) == (1, -1, 1)
    assert cfg.poll_cq_mode is fake_mori.PollCqMode.POLLING
    # MoRI's own default is True; ours must not inherit it.
    assert fake_mori.RdmaBackendConfig().enable_notification is True
    assert cfg.enable_notification is False


@pytest.mark.timeout(10)
def test_notifications_can_be_turned_on(fabric):
    _, cfg = _created_backend(fabric, fake_mori.make_agent("p0", enable_notification=True))
    assert cfg.enable_notification is True


@pytest.mark.timeout(10)
def test_xgmi_config_carries_streams_and_events(fabric):
    agent = fake_mori.make_agent("d0", backend="XGMI", xgmi_num_streams=8, xgmi_num_events=16)
    backend, cfg = _created_backend(fabric, agent)
    assert backend is fake_mori.BackendType.XGMI
    assert isinstance(cfg, fake_mori.XgmiBackendConfig)
    assert (cfg.num_streams, cfg.num_events) == (8, 16)


@pytest.mark.timeout(10)
def test_engine_key_carries_key_epoch_and_pid(fabric):
    agent = fake_mori.make_agent("prefill-0", epoch=7)
    assert agent.mori_key == mori_engine_key("prefill-0", 7, os.getpid())
    assert "prefill-0" in agent.mori_key and "7" in agent.mori_key and str(os.getpid()) in agent.mori_key
    assert mori_engine_key("prefill-0", 7, 1) != mori_engine_key("prefill-0", 8, 1)
    assert mori_engine_key("prefill-0", 7, 1) != mori_engine_key("prefill-0", 7, 2)
    # one IOEngine per agent, bound to the node IP with an ephemeral port
    ((key, host, port),) = fabric.methods(agent.mori_key, "__init__")
    assert (key, host, port) == (agent.mori_key, agent.engine_desc().host, 0)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"backend": "tcpx"}, "backend: 'tcpx' is not one of rdma, xgmi"),
        ({"qp_per_transfer": 0}, "qp_per_transfer: 0 must be >= 1"),
        ({"post_batch_size": 0}, "post_batch_size: 0 must be >= 1 or exactly -1"),
        ({"post_batch_size": -2}, "post_batch_size: -2 must be >= 1 or exactly -1"),
        ({"num_workers": 0}, "num_workers: 0 must be >= 1"),
        ({"poll_cq_mode": "busy"}, "poll_cq_mode: 'busy' is not one of polling, event"),
        ({"xgmi_num_streams": 0}, "xgmi_num_streams: 0 must be >= 1"),
        ({"xgmi_num_events": 0}, "xgmi_num_events: 0 must be >= 1"),
    ],
)
def test_bad_knobs_raise_config_error_naming_the_field(knobs, message):
    data = {"transfer": {"backend": "mori", "mori": knobs}}
    with pytest.raises(ConfigError) as info:
        parse_pipeline_config(data)
    assert f"transfer.mori.{message}" in str(info.value)


@pytest.mark.timeout(10)
def test_backend_and_poll_mode_are_case_insensitive():
    cfg = MoriConfig(backend="RDMA", poll_cq_mode="Event", post_batch_size=-1)
    assert (cfg.backend, cfg.poll_cq_mode) == ("rdma", "event")
    assert TransferConfig(backend="MORI").backend == "mori"
