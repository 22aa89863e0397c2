"""The two AMD Serve configs parse to the intended pipeline, and drive the mori backend as intended.

The backend part runs on a FAKE ``mori`` (``tests/unit/fake_mori.py``): there is no AMD hardware
here and the real ``amd-mori`` wheels are cp310/ROCm only.
"""

from __future__ import annotations

from pathlib import Path

import fake_mori  # tests/unit is on sys.path under pytest (no __init__.py here)
import pytest
import yaml

from moriio_ray import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
XGMI = CONFIGS / "mi300x_1p1d_mori_xgmi.yaml"
RDMA = CONFIGS / "mi300x_xpyd_mori_rdma.yaml"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("path", [XGMI, RDMA])
def test_serve_file_shape(path):
    doc = yaml.safe_load(path.read_text())
    (app,) = doc["applications"]
    assert app["import_path"] == "serve_apps.pd_openai:app"
    assert app["route_prefix"] == "/"
    head = path.read_text().splitlines()[0]
    assert head.startswith("#")
    text = path.read_text()
    assert (
        "amd-mori" in text
        and "ROCm" in text
        and "MI300X" in text
        and f"serve run configs/{path.name}" in text
    )


@pytest.mark.timeout(10)
def test_xgmi_1p1d():
    cfg = load_config(XGMI)
    assert cfg.model.preset is None and str(cfg.model.path).endswith("Llama-3.1-8B-Instruct")
    assert (cfg.model.dtype, cfg.engine.device) == ("bfloat16", "cuda")
    t = cfg.transfer
    assert (t.backend, t.mode, t.timeout_s, t.kv_lease_s) == ("mori", "read", 30.0, 60.0)
    assert (t.mori.backend, t.mori.xgmi_num_streams, t.mori.xgmi_num_events) == ("xgmi", 64, 64)
    pool = cfg.pool
    assert (pool.prefill.replicas, pool.decode.replicas, pool.colocated.replicas) == (1, 1, 0)
    assert (pool.prefill.num_gpus, pool.decode.num_gpus) == (1.0, 1.0)
    assert pool.placement_strategy == "STRICT_PACK"  # xgmi reaches one host only
    assert cfg.mode == "read"


@pytest.mark.timeout(10)
def test_rdma_2p2d():
    cfg = load_config(RDMA)
    assert str(cfg.model.path).endswith("Llama-3.1-8B-Instruct") and cfg.engine.device == "cuda"
    t = cfg.transfer
    assert (t.backend, t.mode, t.timeout_s, t.kv_lease_s) == ("mori", "write", 30.0, 60.0)
    m = t.mori
    assert (m.backend, m.qp_per_transfer, m.post_batch_size, m.num_workers) == ("rdma", 2, -1, 1)
    assert (m.poll_cq_mode, m.enable_notification) == ("polling", False)
    pool = cfg.pool
    assert (pool.prefill.replicas, pool.decode.replicas) == (2, 2)
    assert (pool.prefill.num_gpus, pool.decode.num_gpus) == (1.0, 1.0)
    assert pool.placement_strategy == "SPREAD"


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("path", "kind"), [(XGMI, "XGMI"), (RDMA, "RDMA")])
def test_configs_drive_the_mori_backend(monkeypatch, path, kind):
    fabric = fake_mori.install(monkeypatch)
    transfer = load_config(path).transfer
    agent = fake_mori.cpu_agent_class()(transfer, "prefill-0")
    ((backend, mori_cfg),) = fabric.methods(agent.mori_key, "create_backend")
    assert backend is getattr(fake_mori.BackendType, kind)
    if kind == "RDMA":
        assert (mori_cfg.qp_per_transfer, mori_cfg.enable_notification) == (2, False)
    else:
        assert (mori_cfg.num_streams, mori_cfg.num_events) == (64, 64)
    agent.close()
