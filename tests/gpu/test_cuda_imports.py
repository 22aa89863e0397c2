"""No CUDA library is imported (nor CUDA initialised) unless the cuda_ipc backend is used.

Runs everywhere (no GPU needed). A stand-in ``cupy`` and ``triton`` package on the path records an
import that should not happen: on a CPU host without CuPy an unwanted import would otherwise
just fail and be swallowed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moriio_ray import env

PROBE = r"""
import json, sys
import moriio_ray
from moriio_ray.transfer import TransferConfig, agent_class, create_agent
cls = agent_class("cuda_ipc")  # the module loads, its CUDA libraries do not
made = []
for backend in ("tcp", "shm"):
    try:
        agent = create_agent(TransferConfig(backend=backend), "probe-" + backend)
    except ImportError:
        continue
    made.append(backend)
    agent.close()
import torch
print(json.dumps({
    "cls": cls.__name__,
    "made": made,
    "loaded": sorted(m for m in ("cupy", "triton", "cuda") if m in sys.modules),
    "cuda_initialised": torch.cuda.is_initialized(),
}))
"""


@pytest.mark.timeout(120)
def test_cuda_libraries_load_only_when_cuda_ipc_is_used(tmp_path: Path) -> None:
    for name in ("cupy", "triton"):  # stand-ins: importable, so an unwanted import shows in sys.modules
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("STAND_IN = True\n")
    root = Path(__file__).resolve().parents[2]
    path = ":".join(p for p in (str(tmp_path), str(root), env.get("PYTHONPATH")) if p)
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={"PYTHONPATH": path, "PATH": env.get("PATH"), "HOME": env.get("HOME", "/tmp")},
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["cls"] == "CudaIpcAgent"
    assert result["made"], "neither a tcp nor a shm agent could be created"
    assert result["loaded"] == [], f"imported without cuda_ipc in use: {result['loaded']}"
    assert result["cuda_initialised"] is False
