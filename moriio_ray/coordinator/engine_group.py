"""The actors of one engine: its worker, plus one rank actor per extra tensor-parallel rank.

A pool member is one engine. At ``tensor_parallel_size`` = 1 that is one worker actor in one
bundle, as always; at N > 1 it is the worker (rank 0) and N - 1 ``RankWorker`` actors, all in the
engine's one bundle (N times a rank's resources), so that they land on one node. The coordinator
starts, pings and kills the group as a whole: a dead rank fails its whole engine.
"""

from __future__ import annotations

from typing import Any

import ray

from moriio_ray.config import PipelineConfig, PoolConfig, RoleConfig
from moriio_ray.errors import ConfigError

ROLES = ("prefill", "decode", "colocated")


def bundle(rc: RoleConfig) -> dict[str, float]:
    """One engine's bundle: every rank's CPUs, GPUs and custom resources."""
    ranks = rc.tensor_parallel_size
    per_rank: dict[str, float] = {"CPU": rc.num_cpus, "GPU": rc.num_gpus, **rc.resources}
    total = {k: v * ranks for k, v in per_rank.items() if v > 0}
    return total or {"CPU": 0.01}  # a bundle may not be empty


def check_node_fit(pool: PoolConfig, nodes: list[dict[str, Any]]) -> None:
    """ConfigError when a tensor-parallel engine needs more GPUs than any one node holds.

    ``nodes`` is ``ray.nodes()``: an engine's ranks share one node, so the largest node bounds
    ``tensor_parallel_size * num_gpus``."""
    most = max((n.get("Resources", {}).get("GPU", 0.0) for n in nodes if n.get("Alive", True)), default=0.0)
    for role in ROLES:
        rc: RoleConfig = getattr(pool, role)
        need = rc.tensor_parallel_size * rc.num_gpus
        if rc.replicas > 0 and rc.tensor_parallel_size > 1 and need > most:
            raise ConfigError(
                f"pool.{role}.tensor_parallel_size: {rc.tensor_parallel_size} ranks of {rc.num_gpus:g} "
                f"GPU need {need:g} GPUs on one node; the largest node of this cluster has {most:g}"
            )


def check_tp_sizes(config: PipelineConfig) -> None:
    """ConfigError now when a preset's heads do not split into a role's ``tensor_parallel_size``
    (a checkpoint's are known only once a worker reads it: the worker checks those)."""
    if config.model.preset is None:
        return
    from moriio_ray.engine.presets import preset_args  # no torch
    from moriio_ray.engine.tp_size import check_tp_size

    args = preset_args(config.model)
    for role in ROLES:
        rc: RoleConfig = getattr(config.pool, role)
        if rc.replicas > 0:
            check_tp_size(args, rc.tensor_parallel_size, f"pool.{role}.tensor_parallel_size")


def start_ranks(
    config: PipelineConfig, role: str, key: str, epoch: int, token: bytes, options: dict[str, Any]
) -> list[Any]:
    """Ranks 1.. of an engine (their actors; each builds itself when rank 0 calls ``join``)."""
    size = getattr(config.pool, role).tensor_parallel_size
    if size == 1:
        return []
    from moriio_ray.worker.rank_actor import make_rank_actor_class  # the worker's code

    cls = make_rank_actor_class()
    name = options.get("name")  # a named (detached) engine's ranks are named after it
    return [
        cls.options(**{**options, "name": rank_name(name, r)} if name else options).remote(
            config, role, key, r, size, epoch=epoch, token=token
        )
        for r in range(1, size)
    ]


def rank_name(worker: str, rank: int) -> str:
    return f"{worker}:rank{rank}"


def kill_all(actors: list[Any]) -> None:
    for actor in actors:
        ray.kill(actor, no_restart=True)
