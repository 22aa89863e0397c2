"""The backend registry: lazy imports and a clear error for an unknown backend."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moriio_ray.config import TransferConfig
from moriio_ray.errors import ConfigError
from moriio_ray.transfer import agent_class, create_agent

BACKEND_MODULES = [f"moriio_ray.transfer.{name}" for name in ("tcp", "shm", "cuda_ipc", "mori")]


def _modules_after(code: str) -> set[str]:
    """The module names loaded by a fresh interpreter after running ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.timeout(60)
def test_import_moriio_ray_loads_no_backend_no_ray_no_torch() -> None:
    loaded = _modules_after("import moriio_ray")
    assert "moriio_ray" in loaded
    heavy = {"ray", "torch", *BACKEND_MODULES} & loaded
    assert not heavy, f"import moriio_ray loaded {sorted(heavy)}"


@pytest.mark.timeout(60)
def test_import_transfer_loads_no_backend_no_ray_no_torch() -> None:
    loaded = _modules_after("import moriio_ray.transfer")
    assert "moriio_ray.transfer" in loaded and "moriio_ray.transfer.base" not in loaded
    heavy = {"ray", "torch", *BACKEND_MODULES} & loaded
    assert not heavy, f"import moriio_ray.transfer loaded {sorted(heavy)}"
    # the re-exports load on first use
    loaded = _modules_after("import moriio_ray.transfer as t\nt.TransferAgent, t.plan_blocks")
    assert {"moriio_ray.transfer.base", "moriio_ray.transfer.plan"} <= loaded


@pytest.mark.timeout(60)
def test_caller_side_loads_no_torch_and_no_worker_code() -> None:
    loaded = _modules_after(
        "import moriio_ray.caller.pipeline, moriio_ray.coordinator.actor, moriio_ray.serve.app"
    )
    heavy = {
        m
        for m in loaded
        if m in ("torch", "moriio_ray.engine.model", "moriio_ray.engine.engine")
        or m.startswith("moriio_ray.worker")
    }
    assert not heavy, f"the caller side loaded {sorted(heavy)}"


@pytest.mark.timeout(60)
def test_the_coordinators_spawn_path_loads_no_torch() -> None:
    """The coordinator builds the worker actor classes (``make_actor_class``, and the rank actors'
    of a tensor-parallel engine) in its own process: that must load no torch, no engine, no agent."""
    loaded = _modules_after(
        "import moriio_ray.coordinator.actor\n"
        "from moriio_ray.worker.actor import make_actor_class\n"
        "from moriio_ray.worker.rank_actor import make_rank_actor_class\n"
        "make_actor_class(), make_rank_actor_class()"
    )
    assert "ray" in loaded and "moriio_ray.worker.actor" in loaded  # the path did run
    heavy = {
        m
        for m in loaded
        if m == "torch"
        or m.startswith(("torch.", "moriio_ray.engine.engine", "moriio_ray.engine.model"))
        or m in ("moriio_ray.worker.core", "moriio_ray.transfer.base", *BACKEND_MODULES)
    }
    assert not heavy, f"the coordinator's spawn path loaded {sorted(heavy)}"


@pytest.mark.timeout(60)
def test_choosing_a_backend_imports_only_that_backend() -> None:
    loaded = _modules_after("import moriio_ray.transfer as t\nt.agent_class('shm')")
    assert "moriio_ray.transfer.shm" in loaded
    others = {"ray", *BACKEND_MODULES} - {"moriio_ray.transfer.shm"}
    assert not others & loaded, f"agent_class('shm') loaded {sorted(others & loaded)}"


@pytest.mark.timeout(30)
def test_unknown_backend_lists_the_known_ones() -> None:
    with pytest.raises(
        ConfigError, match=r"transfer\.backend: 'nccl' is not one of tcp, shm, cuda_ipc, mori"
    ):
        agent_class("nccl")
    with pytest.raises(ConfigError, match=r"^backend: 'nccl' is not one of tcp, shm, cuda_ipc, mori$"):
        TransferConfig(backend="nccl")


@pytest.mark.timeout(30)
def test_agent_class_is_case_insensitive_and_create_agent_needs_a_key() -> None:
    assert agent_class("SHM").name == "shm"
    with pytest.raises(ConfigError, match="key: an agent needs a non-empty engine key"):
        create_agent(TransferConfig(backend="shm"), "")
    with create_agent(TransferConfig(backend="tcp"), "prefill-0", epoch=2) as agent:
        desc = agent.engine_desc()
        assert (desc.key, desc.backend, desc.epoch) == ("prefill-0", "tcp", 2)
