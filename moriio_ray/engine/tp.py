"""Tensor parallelism: one rank's process group, its share of the heads, and the row-parallel linear.

Megatron-style sharding of the decoder over ``size`` ranks:
- ``qkv_proj`` and ``gate_up_proj`` are column-parallel: rank r keeps its query heads, its KV heads
  and its slice of the MLP's intermediate rows, so attention and the gated activation run locally;
- ``o_proj`` and ``down_proj`` are row-parallel: each rank multiplies its input slice and one
  all-reduce sums the partial outputs (two per layer);
- the embedding, the norms and the LM head are replicated (every rank holds them whole): the
  sampler on rank 0 needs full logits, and replicating them costs no collective.

A sharded model is built from ``shard_args`` (the per-rank head and row counts), so the attention,
the MLP and the KV cache code are the same at every size; at size 1 nothing changes and no
collective runs. Collectives use NCCL on CUDA and gloo on the CPU; the per-step control message
(``tp_steps``) always goes over a gloo group. A collective that fails (a peer rank died) calls the
group's ``on_broken`` before raising: a worker ends its process there, so that the whole engine is
seen dead at once (its callers and the coordinator treat it as any dead worker).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from moriio_ray.engine.arch import ModelArgs
from moriio_ray.engine.tp_size import check_tp_size

# An idle follower waits for the next step message as long as the engine lives; a dead peer is
# noticed through its closed connection, never through this timeout.
CONTROL_TIMEOUT = datetime.timedelta(days=3650)
DEVICE_TIMEOUT = datetime.timedelta(minutes=10)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class TPGroup:
    """One rank of a tensor-parallel engine (``size == 1``: no group, no collectives)."""

    rank: int = 0
    size: int = 1
    device_group: Any = None  # torch.distributed ProcessGroup for activations (NCCL or gloo)
    control_group: Any = None  # gloo ProcessGroup for the per-step messages
    on_broken: Callable[[BaseException], None] | None = None  # a collective failed: the group is gone

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


SINGLE = TPGroup()


def shard_args(args: ModelArgs, size: int) -> ModelArgs:
    """The architecture one rank builds: its share of the heads and of the MLP's rows."""
    if size == 1:
        return args
    check_tp_size(args, size)
    return dataclasses.replace(
        args,
        num_heads=args.num_heads // size,
        num_kv_heads=args.num_kv_heads // size,
        intermediate_size=args.intermediate_size // size,
    )


class RowParallelLinear(nn.Linear):
    """``y = sum over ranks (x_r @ W_r^T) + b``: ``weight`` holds this rank's input columns, ``bias``
    is whole and added once after the all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        y = F.linear(x, self.weight)  # [T, out]: this rank's partial sum
        collective(self.tp, dist.all_reduce, y, group=self.tp.device_group)
        return y if self.bias is None else y + self.bias


def collective(tp: TPGroup, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run one collective of the group; if it fails, tell ``tp.on_broken`` first, then raise."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        if tp.on_broken is not None:
            tp.on_broken(exc)
        raise


def row_linear(in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE) -> nn.Linear:
    """A row-parallel projection; at size 1 a plain ``nn.Linear`` (the unsharded model unchanged)."""
    if tp.size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_group(
    rank: int,
    size: int,
    store: Any,
    device: torch.device,
    on_broken: Callable[[BaseException], None] | None = None,
) -> TPGroup:
    """Join the engine's process group through ``store`` (a torch.distributed Store that every rank
    reaches; rank 0's worker hosts it on an ephemeral port, so no port is ever guessed)."""
    import torch.distributed as dist

    if size == 1:
        return SINGLE
    backend = backend_for(device)
    timeout = CONTROL_TIMEOUT if backend == "gloo" else DEVICE_TIMEOUT
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    device_group = dist.group.WORLD
    control = device_group if backend == "gloo" else dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPGroup(rank, size, device_group, control, on_broken)


def destroy_group(tp: TPGroup) -> None:
    """Leave the process group (idempotent; a no-op at size 1)."""
    if tp.size == 1:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
