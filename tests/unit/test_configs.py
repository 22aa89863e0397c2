"""Every file in configs/ is a valid Ray Serve config whose args load as a PipelineConfig."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from moriio_ray import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.timeout(10)
def test_there_are_configs() -> None:
    names = {p.name for p in CONFIGS}
    ours = {
        "smollm2_1p1d_cpu.yaml",
        "tiny_1p1d_cpu.yaml",
        "tiny_2p2d_cpu_tcp.yaml",
        "llama1b_1p1d_cuda.yaml",
        "multinode_tcp.yaml",
    }
    assert ours <= names


@pytest.mark.timeout(10)
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.name
    text = path.read_text()
    assert text.startswith("#"), "each config opens with a comment saying what it needs and how to run it"
    assert "Run:" in text or "run:" in text


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_a_serve_config_for_our_app(path: Path) -> None:
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    assert [app.import_path for app in schema.applications] == ["serve_apps.pd_openai:app"]


def _make_default_config() -> Path:
    makefile = (CONFIGS[0].parents[1] / "Makefile").read_text()
    line = next(ln for ln in makefile.splitlines() if ln.startswith("CONFIG ?="))
    return CONFIGS[0].parents[1] / line.split("?=", 1)[1].strip()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", ["default", "tiny_1p1d_cpu.yaml"])
def test_default_config_runs_on_a_small_cpu_box(name: str) -> None:
    path = _make_default_config() if name == "default" else CONFIGS[0].parent / name
    cfg = load_config(path)
    assert cfg.engine.device == "cpu" and cfg.transfer.backend == "shm"
    if name == "default":  # make serve serves a real model, whose weights a pip package ships
        assert path.name == "smollm2_1p1d_cpu.yaml" and cfg.model.path == "smollm2-135m-instruct"
    else:
        assert cfg.model.preset == "tiny"
    pool = cfg.pool
    assert (pool.prefill.replicas, pool.decode.replicas) == (1, 1)
    assert pool.prefill.num_cpus + pool.decode.num_cpus <= 2, "must fit on a 2-core machine"
    assert pool.prefill.num_gpus == pool.decode.num_gpus == 0


@pytest.mark.timeout(10)
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_runs_serve_in_the_fast_mode(path: Path) -> None:
    """`serve run` of any shipped config starts Serve's controller with the fast path's flags."""
    from moriio_ray.serve.serve_mode import FAST_ENV, controller_env, mode_of

    doc = yaml.safe_load(path.read_text())
    assert mode_of(doc) == "fast" and controller_env(doc) == FAST_ENV
    # HAProxy binds every interface unless http_options.host says otherwise: say it in every file
    assert doc.get("http_options", {}).get("host") in ("127.0.0.1", "0.0.0.0")


@pytest.mark.timeout(10)
def test_the_docs_show_the_fast_path_block_the_configs_carry() -> None:
    from moriio_ray.serve.serve_mode import FAST_ENV, controller_env

    readme = (CONFIGS[0].parents[1] / "docs" / "serve.md").read_text()
    block = readme.split("```yaml\ncontroller_options:", 1)[1].split("```", 1)[0]
    assert controller_env(yaml.safe_load("controller_options:" + block)) == FAST_ENV
