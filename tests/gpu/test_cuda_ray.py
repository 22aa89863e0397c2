"""cuda_ipc inside real Ray actors: each actor gets its own GPU, sees both, and pulls from the other."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cuda_ipc_peer import pattern

from moriio_ray import env
from moriio_ray.transfer.cuda_devices import RAY_NOSET_CUDA_VISIBLE_DEVICES, ray_actor_env

REGION_BYTES = 4 << 20


class Worker:
    """A minimal engine-like actor: an agent on the GPU Ray assigned, one registered region."""

    def __init__(self, key: str, seed: int) -> None:
        import torch

        from moriio_ray.transfer import TransferConfig, create_agent
        from moriio_ray.transfer.cuda_devices import select_device

        self.device = select_device()
        self.agent = create_agent(TransferConfig(backend="cuda_ipc"), key)
        self.region = self.agent.allocate((REGION_BYTES,), torch.uint8, self.device)
        self.region.copy_(torch.from_numpy(pattern(REGION_BYTES, seed)))
        self.mem = self.agent.register(self.region)

    def info(self) -> dict[str, Any]:
        import ray
        import torch

        return {
            "device": self.device.index,
            "uuid": str(torch.cuda.get_device_properties(self.device).uuid),
            "visible": torch.cuda.device_count(),
            "ray_gpu_ids": [str(i) for i in ray.get_gpu_ids()],
            "desc": self.agent.engine_desc(),
            "mem": self.mem,
        }

    def pull(self, desc: Any, mem: Any, start: int, stop: int) -> np.ndarray:
        """Read the peer's bytes [start, stop) into the same place here; return them from here."""
        import torch

        from moriio_ray.transfer.plan import TransferPlan

        self.agent.connect(desc)
        self.agent.read(self.mem, mem, TransferPlan([start], [start], [stop - start])).wait(timeout_s=30)
        torch.cuda.synchronize(self.device)
        return self.region[start:stop].cpu().numpy()


def test_ray_actor_env_names_rays_variable() -> None:
    assert ray_actor_env() == {RAY_NOSET_CUDA_VISIBLE_DEVICES: "1"}
    assert RAY_NOSET_CUDA_VISIBLE_DEVICES == "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


@pytest.mark.gpu(min_gpus=2)
@pytest.mark.timeout(240)
def test_two_ray_actors_on_two_gpus_move_data_through_cuda_ipc() -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, namespace="moriio_ray_gpu_test")
    try:
        # the workers import this test module (Worker, pattern) by name
        here = str(Path(__file__).parent)
        path = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
        env_vars = {**ray_actor_env(), "PYTHONPATH": path}
        actor = ray.remote(num_gpus=1)(Worker).options(runtime_env={"env_vars": env_vars})
        a, b = actor.remote("ray-a", 31), actor.remote("ray-b", 32)
        info_a, info_b = ray.get([a.info.remote(), b.info.remote()], timeout=180)
        assert info_a["visible"] == info_b["visible"] == 2, "workers must see both GPUs"
        assert info_a["ray_gpu_ids"] != info_b["ray_gpu_ids"]
        assert info_a["uuid"] != info_b["uuid"], "select_device gave both actors the same GPU"
        half = REGION_BYTES // 2
        # a pulls b's first half over a's own bytes, then b pulls a's (untouched) second half
        got = ray.get(a.pull.remote(info_b["desc"], info_b["mem"], 0, half), timeout=60)
        assert np.array_equal(got, pattern(REGION_BYTES, 32)[:half])
        got = ray.get(b.pull.remote(info_a["desc"], info_a["mem"], half, REGION_BYTES), timeout=60)
        assert np.array_equal(got, pattern(REGION_BYTES, 31)[half:])
    finally:
        ray.shutdown()
