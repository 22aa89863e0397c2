"""One rank's part of an engine, and the follower loop of tensor-parallel ranks other than 0.

``build_rank`` makes what every rank holds: its share of the model, its paged KV cache (its KV
heads, allocated through and registered with its own transfer agent), the decode CUDA graphs and
the runner. ``Engine`` is rank 0 (it also schedules and samples); ``RankEngine`` is any other rank:
it waits for rank 0's step message, runs the same forward pass on its shard and waits again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from moriio_ray.config import SIM, EngineConfig, ModelConfig
from moriio_ray.engine.batch import PrefillChunk
from moriio_ray.engine.cuda_graph import DecodeGraphs
from moriio_ray.engine.device import resolve_device, resolve_dtype
from moriio_ray.engine.fused_forward import use_triton
from moriio_ray.engine.kv_cache import KVCache
from moriio_ray.engine.loader import load_model, model_args, resolve_max_model_len
from moriio_ray.engine.runner import ModelRunner, StepModel
from moriio_ray.engine.sequence import blocks_for
from moriio_ray.engine.sim_model import SimModel, SimRunner, sim_device
from moriio_ray.engine.tp import SINGLE, TPGroup
from moriio_ray.engine.tp_size import check_tp_size, shard_range
from moriio_ray.engine.tp_steps import Kind, StepChannel, StepMsg, decode_batch
from moriio_ray.errors import ConfigError, InvalidRequest

if TYPE_CHECKING:
    from moriio_ray.engine.arch import ModelArgs
    from moriio_ray.transfer.base import TransferAgent

log = logging.getLogger(__name__)

LayerHook = Callable[[int, list[PrefillChunk]], None]


@dataclasses.dataclass
class RankParts:
    """What one rank runs: model shard, KV cache, graphs (CUDA decode) and runner."""

    device: torch.device
    dtype: torch.dtype
    args: ModelArgs  # the full model's architecture
    max_model_len: int
    model: StepModel  # CausalLM, or SimModel
    cache: KVCache
    graphs: DecodeGraphs | None
    runner: ModelRunner  # a SimRunner for the simulated model

    @property
    def num_blocks(self) -> int:
        """Blocks requests may use (the scratch block of padded graph rows excluded)."""
        return self.cache.num_blocks - int(self.graphs is not None)


def build_rank(
    model: ModelConfig,
    engine: EngineConfig,
    *,
    role: str,
    agent: TransferAgent | None,
    tp: TPGroup = SINGLE,
    cuda_graphs: bool = True,
) -> RankParts:
    if model.preset == SIM:
        return _build_sim(model, engine, agent, tp)
    device = resolve_device(engine.device)
    dtype = resolve_dtype(model.dtype, device)
    args = model_args(model)
    check_tp_size(args, tp.size)
    max_model_len = resolve_max_model_len(args, model.max_model_len)
    net = load_model(model, device, dtype, max_model_len, tp)
    net.fused = use_triton(engine.kernels, device)
    # on CUDA, decode steps replay CUDA graphs; their padding rows write into one scratch block
    # (a prefill engine never decodes, so it needs none)
    use_graphs = cuda_graphs and device.type == "cuda" and role != "prefill"
    heads = shard_range(args.num_kv_heads, tp.rank, tp.size)
    cache = KVCache(
        net.args, engine, dtype, device, agent, extra_blocks=int(use_graphs), heads=heads,
        total_kv_heads=args.num_kv_heads if tp.size > 1 else 0,
    )  # fmt: skip
    with_logits = tp.is_leader
    graphs = None
    if use_graphs:
        scratch = cache.num_blocks - 1
        graphs = DecodeGraphs(
            net, cache.layers, engine.block_size, scratch, engine.max_num_seqs, max_model_len, device,
            with_logits=with_logits,
        )  # fmt: skip
    runner = ModelRunner(net, cache, device, graphs, with_logits=with_logits)
    return RankParts(device, dtype, args, max_model_len, net, cache, graphs, runner)


def _build_sim(
    model: ModelConfig, engine: EngineConfig, agent: TransferAgent | None, tp: TPGroup
) -> RankParts:
    """The simulated model's rank: a KV cache of its geometry and a runner on its virtual device."""
    if tp.size > 1:
        raise ConfigError(
            f"tensor_parallel_size: {tp.size}: the simulated model (model.preset: sim) runs one rank per "
            "engine; set 1"
        )
    device = sim_device(engine.device)
    dtype = resolve_dtype(model.dtype, device)
    args = model_args(model)
    max_model_len = resolve_max_model_len(args, model.max_model_len)
    cache = KVCache(args, engine, dtype, device, agent)
    assert model.sim is not None  # ModelConfig fills it in for preset sim
    net = SimModel(model.sim, cache)
    return RankParts(device, dtype, args, max_model_len, net, cache, None, SimRunner(net, cache, device))


class RankEngine:
    """A tensor-parallel rank other than 0: runs every batch rank 0 broadcasts, on its shard.

    ``follow`` blocks (call it on the rank's engine thread) until rank 0 sends STOP or the group
    breaks (a peer rank died: the collective raises, and the caller fails the whole engine).
    """

    def __init__(
        self,
        model: ModelConfig,
        engine: EngineConfig,
        *,
        role: str,
        tp: TPGroup,
        agent: TransferAgent | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        assert tp.size > 1 and not tp.is_leader, "rank 0 is the Engine itself"
        self.role = role
        self.tp = tp
        self.parts = build_rank(model, engine, role=role, agent=agent, tp=tp, cuda_graphs=cuda_graphs)
        self.block_size = engine.block_size
        self.cache = self.parts.cache
        self.layout = self.cache.layout
        self.kv_mem = self.cache.mem
        self.channel = StepChannel(tp)
        self.num_steps = 0
        self._layer_hook: LayerHook | None = None
        self._prompt_blocks: dict[str, list[int]] = {}

    def set_layer_hook(self, hook: LayerHook | None) -> None:
        """As ``Engine.set_layer_hook``: ``hook(layer, chunks)`` in each step that prefills."""
        self._layer_hook = hook

    def prefill_blocks(self, request_id: str) -> list[int]:
        """In the layer hook: the blocks holding the prompt of a request of the running prefill."""
        blocks = self._prompt_blocks.get(request_id)
        if blocks is None:
            raise InvalidRequest(f"request_id: {request_id!r} is not in this rank's running prefill")
        return blocks

    def follow(self) -> None:
        while True:
            msg = self.channel.recv()
            if msg.kind is Kind.STOP:
                return
            if msg.kind is Kind.CAPTURE:
                if self.parts.graphs is not None:
                    self.parts.graphs.capture_all()
                continue
            self._run(msg)

    def _run(self, msg: StepMsg) -> None:
        batch = decode_batch(msg)
        hook = self._layer_hook
        layer_hook = None
        chunks = msg.chunks
        if chunks and hook is not None:
            tables = msg.tables[msg.num_decodes :]
            self._prompt_blocks = {
                c.request_id: table[: blocks_for(c.num_prompt_tokens, self.block_size)]
                for c, table in zip(chunks, tables, strict=True)
            }
            layer_hook = lambda i: hook(i, chunks)
        self.parts.runner.run(batch, layer_hook)
        self._prompt_blocks = {}
        self.num_steps += 1

    def close(self) -> None:
        self.cache.close()
