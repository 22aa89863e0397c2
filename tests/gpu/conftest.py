"""GPU tests: marked ``gpu`` and skipped, with the reason, where CUDA, CuPy or enough GPUs are absent.

Run them on a GPU host with ``pytest tests/gpu -m gpu``. A test that needs two GPUs carries
``@pytest.mark.gpu(min_gpus=2)``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest


def _gpu_count() -> tuple[int, str]:
    """(visible CUDA GPUs, why none can be used)."""
    try:
        import torch
    except ImportError:
        return 0, "torch is not installed"
    if not torch.cuda.is_available():
        return 0, "CUDA is not available (no NVIDIA GPU or a CPU build of torch)"
    if importlib.util.find_spec("cupy") is None:
        return 0, "CuPy is not installed (cuda_ipc compiles its copy kernel with it)"
    return torch.cuda.device_count(), ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    count, why = _gpu_count()
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        need = int(marker.kwargs.get("min_gpus", 1))
        if count == 0:
            item.add_marker(pytest.mark.skip(reason=why))
        elif count < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} GPUs, {count} visible"))


@pytest.fixture(scope="module")
def ray_gpus() -> Iterator[None]:
    """A local Ray over this host's GPUs, for one test module."""
    import ray

    if not ray.is_initialized():
        ray.init(namespace="moriio_ray", include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
