"""Every config of the pipeline, as frozen msgspec Structs.

A bad value raises ConfigError naming the field, the value and what is allowed, e.g.
``transfer.mori.backend: 'tcpx' is not one of rdma, xgmi``. ``config_load`` builds a
PipelineConfig from plain data (``parse_pipeline_config``) or a file (``load_config``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TypeVar

import msgspec

# the backends' sections are part of this module's API (re-exported)
from moriio_ray.config_backends import CUDA_IPC_METHODS as CUDA_IPC_METHODS
from moriio_ray.config_backends import CudaIpcConfig as CudaIpcConfig
from moriio_ray.config_backends import MoriConfig as MoriConfig
from moriio_ray.config_backends import TcpConfig as TcpConfig
from moriio_ray.config_checks import STRUCT as _STRUCT
from moriio_ray.config_checks import at_least as _at_least
from moriio_ray.config_checks import choice as _choice
from moriio_ray.config_checks import fraction as _fraction
from moriio_ray.config_checks import positive as _positive
from moriio_ray.errors import ConfigError

T = TypeVar("T")

# ----------------------------------------------------------------------------------------------
# transfer

BACKENDS = ("tcp", "shm", "cuda_ipc", "mori")


class TransferConfig(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """How KV moves between engines."""

    backend: str = "shm"  # tcp | shm | cuda_ipc | mori
    mode: str = "read"  # read (D pulls) | write (P pushes layer by layer)
    timeout_s: float = 10.0  # one transfer's deadline
    kv_lease_s: float = 30.0  # how long P pins a prompt's blocks for D
    lease_grace_s: float = 5.0  # P frees an unreleased lease only after lease + grace
    read_margin_s: float = 0.5  # D never starts or continues a read past lease deadline - margin
    on_transfer_failure: str = "recompute"  # recompute | fail
    tcp: TcpConfig = msgspec.field(default_factory=TcpConfig)
    mori: MoriConfig = msgspec.field(default_factory=MoriConfig)
    cuda_ipc: CudaIpcConfig = msgspec.field(default_factory=CudaIpcConfig)

    def __post_init__(self) -> None:
        _choice(self, "backend", BACKENDS)
        _choice(self, "mode", ("read", "write"))
        _positive(self, "timeout_s")
        _positive(self, "kv_lease_s")
        _at_least(self, "lease_grace_s", 0.0)
        _at_least(self, "read_margin_s", 0.0)
        _choice(self, "on_transfer_failure", ("recompute", "fail"))
        if self.read_margin_s >= self.kv_lease_s:
            raise ConfigError(
                f"read_margin_s: {self.read_margin_s!r} must be below kv_lease_s ({self.kv_lease_s})"
            )


# ----------------------------------------------------------------------------------------------
# model and engine

DTYPES = ("auto", "float32", "bfloat16", "float16")
SIM = "sim"  # the preset whose forward pass waits instead of computing (engine/sim_model.py)
_BYTE_VOCAB_SIZE = 260  # the byte tokenizer's ids (engine/presets.BYTE_VOCAB_SIZE), which presets use


class SimConfig(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """The simulated model (``model.preset: sim``): each step takes ``step_fixed_ms +
    step_per_decode_row_us * decode rows + step_per_prefill_token_us * prefill tokens`` of a
    virtual device's time, over a real KV cache of this geometry. The default timing is
    ``llama-1b`` in bfloat16 on one H200 (engine/sim_model.py gives the fit); the default geometry is
    llama-1b's KV cache."""

    step_fixed_ms: float = 1.14  # every step
    step_per_decode_row_us: float = 4.29  # per decode row of a step
    step_per_prefill_token_us: float = 3.96  # per prompt token a step computes
    num_layers: int = 16
    num_kv_heads: int = 8
    head_dim: int = 64
    vocab_size: int = _BYTE_VOCAB_SIZE  # the logits' width (their cost on the host grows with it)

    def __post_init__(self) -> None:
        _at_least(self, "step_fixed_ms", 0.0)
        _at_least(self, "step_per_decode_row_us", 0.0)
        _at_least(self, "step_per_prefill_token_us", 0.0)
        _at_least(self, "num_layers", 1)
        _at_least(self, "num_kv_heads", 1)
        _at_least(self, "head_dim", 1)
        _at_least(self, "vocab_size", _BYTE_VOCAB_SIZE)


class ModelConfig(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """Which weights the engines run: a named preset (seeded random weights) or a local model.

    ``path`` is a local HF-format directory, a ``.gguf`` file, or the name of a model that a pip
    package ships (``smollm2-135m-instruct``). With no ``path``, ``preset`` defaults to ``tiny``.
    """

    preset: str | None = None  # tiny | llama-1b | qwen3-0.6b | llama-8b | sim; tiny when path is unset
    path: str | None = None  # a directory, a .gguf file or a packaged model's name; never downloaded
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    seed: int = 0
    max_model_len: int | None = None  # None: the model's own
    served_name: str | None = None  # the name clients pass as `model`; default from preset/path
    sim: SimConfig | None = None  # preset sim only: its timing and KV geometry (the defaults when unset)

    def __post_init__(self) -> None:
        if self.preset is not None and self.path is not None:
            raise ConfigError(
                f"preset/path: set one of model.preset ({self.preset!r}) and model.path ({self.path!r}), "
                "not both"
            )
        if self.path is None:
            msgspec.structs.force_setattr(self, "preset", self.preset or "tiny")
            _choice(self, "preset", PRESETS)
        elif not str(self.path).strip():
            raise ConfigError("path: must not be empty")
        if self.preset == SIM:
            msgspec.structs.force_setattr(self, "sim", self.sim or SimConfig())
        elif self.sim is not None:
            what = f"preset {self.preset!r}" if self.preset is not None else f"path {self.path!r}"
            raise ConfigError(f"sim: only the simulated model takes it (model.preset: sim), not {what}")
        _choice(self, "dtype", DTYPES)
        if self.max_model_len is not None:
            _at_least(self, "max_model_len", 2)

    @property
    def name(self) -> str:
        if self.served_name:
            return self.served_name
        if self.preset is not None:
            return self.preset
        path = Path(str(self.path))
        return path.stem if path.suffix == ".gguf" else path.name


PRESETS = ("tiny", "llama-1b", "qwen3-0.6b", "llama-8b", SIM)
LAYOUTS = ("layer_major", "block_major")


class EngineConfig(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """Paged cache and continuous batching."""

    device: str = "auto"  # auto | cpu | cuda
    block_size: int = 16
    num_blocks: int | None = None  # None: 512 on CPU, gpu_memory_fraction of free memory on GPU
    gpu_memory_fraction: float = 0.5
    layout: str = "layer_major"  # layer_major | block_major
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096  # tokens per step: every running decode, then prefill chunks
    chunked_prefill: bool = True  # False: a prompt is prefilled in one step, past the budget if need be
    overlap_scheduling: bool | None = None  # None: on for CUDA engines and preset sim, off on the CPU
    cuda_graphs: bool = True  # CUDA devices: decode steps replay graphs, captured before serving
    kernels: str = "auto"  # auto | torch | triton: the CUDA forward (auto: Triton kernels where installed)
    enable_prefix_caching: bool = True  # full blocks found again by their tokens, kept until evicted (LRU)

    def __post_init__(self) -> None:
        _choice(self, "device", ("auto", "cpu", "cuda"))
        _at_least(self, "block_size", 1)
        if self.num_blocks is not None:
            _at_least(self, "num_blocks", 1)
        _fraction(self, "gpu_memory_fraction")
        _choice(self, "layout", LAYOUTS)
        _choice(self, "kernels", ("auto", "torch", "triton"))
        _at_least(self, "max_num_seqs", 1)
        _at_least(self, "max_num_batched_tokens", 1)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens: {self.max_num_batched_tokens} must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence decodes one token in each step"
            )


# ----------------------------------------------------------------------------------------------
# placement and runtime

STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK")
_LABEL = re.compile(r"^[A-Za-z0-9_.\-/]+$")


class RoleConfig(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """One role's pool: how many engines and what each needs.

    ``tensor_parallel_size`` (vLLM's ``-tp``) shards each engine over that many ranks, one process
    each, placed together on one node; ``num_gpus``, ``num_cpus`` and ``resources`` are per rank.
    Whether it divides the model's heads is checked where the model is known (the engine).
    """

    replicas: int = 1
    tensor_parallel_size: int = 1  # ranks per engine
    num_gpus: float = 0.0  # GPUs per rank (per engine at TP = 1); 0 runs the engine on the CPU
    num_cpus: float = 1.0  # per rank
    resources: dict[str, float] = msgspec.field(default_factory=dict)  # custom Ray resources, per rank
    labels: dict[str, str] = msgspec.field(default_factory=dict)  # node label selector

    def __post_init__(self) -> None:
        _at_least(self, "replicas", 0)
        if self.tensor_parallel_size < 1:
            raise ConfigError(
                f"tensor_parallel_size: {self.tensor_parallel_size!r} must be a positive integer"
            )
        _at_least(self, "num_gpus", 0.0)
        if self.tensor_parallel_size > 1 and 0 < self.num_gpus < 1:
            raise ConfigError(
                f"num_gpus: {self.num_gpus!r} with tensor_parallel_size {self.tensor_parallel_size}: each "
                "rank needs a whole GPU (NCCL runs one rank per device); set num_gpus: 1"
            )
        _at_least(self, "num_cpus", 0.0)
        for key, amount in self.resources.items():
            if amount < 0:
                raise ConfigError(f"resources.{key}: {amount!r} must be >= 0")
        for key in self.labels:
            if not _LABEL.match(key):
                raise ConfigError(f"labels: {key!r} is not a valid label key")


class PoolConfig(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """The worker pools. Either prefill + decode (disaggregated) or colocated replicas."""

    prefill: RoleConfig = msgspec.field(default_factory=RoleConfig)
    decode: RoleConfig = msgspec.field(default_factory=RoleConfig)
    colocated: RoleConfig = msgspec.field(default_factory=lambda: RoleConfig(replicas=0))
    placement_strategy: str = "PACK"  # PACK | SPREAD | STRICT_SPREAD | STRICT_PACK, across engines

    def __post_init__(self) -> None:
        _choice(self, "placement_strategy", STRATEGIES, upper=True)
        disagg = self.prefill.replicas > 0 or self.decode.replicas > 0
        if self.colocated.replicas > 0 and disagg:
            raise ConfigError(
                "colocated.replicas: a pool is either colocated or prefill/decode; "
                "set prefill.replicas and decode.replicas to 0 to run colocated"
            )
        if self.colocated.replicas == 0 and (self.prefill.replicas < 1 or self.decode.replicas < 1):
            raise ConfigError(
                "prefill.replicas/decode.replicas: a disaggregated pool needs at least one of each "
                f"(got {self.prefill.replicas} and {self.decode.replicas})"
            )


class RuntimeConfig(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """Coordinator and worker behaviour."""

    # a silent worker: 2 missed pings; a crashed one: at once (its death watch)
    health_check_period_s: float = 0.5
    # a ping round lasts at least (actors / this) seconds: the coordinator's CPU stays bounded at
    # thousands of engines, and silent ones are then found later (docs/control_plane.md)
    max_health_pings_per_s: float = 400.0
    remote_timeout_s: float = 60.0  # every remote await without a tighter deadline; a hung engine step
    prefill_retries: int = 1  # retry a prefill on another P when its P dies
    replace_dead_workers: bool = True
    worker_start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        _positive(self, "health_check_period_s")
        _positive(self, "max_health_pings_per_s")
        _positive(self, "remote_timeout_s")
        _at_least(self, "prefill_retries", 0)
        _positive(self, "worker_start_timeout_s")


class ServeConfig(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """The OpenAI-compatible HTTP front end."""

    max_ongoing_requests: int = 64  # beyond this, 429 (never an unbounded queue)
    request_timeout_s: float = 300.0
    default_max_tokens: int = 64
    num_replicas: int = 1
    stream_interval: int = 8  # tokens per SSE event (the first goes at once; 1: one per output)
    # a request field the server does not know: a 400 naming it, or ignored (named in a header)
    unknown_fields: str = "ignore"  # reject | ignore

    def __post_init__(self) -> None:
        _choice(self, "unknown_fields", ("reject", "ignore"))
        _at_least(self, "max_ongoing_requests", 1)
        _positive(self, "request_timeout_s")
        _at_least(self, "default_max_tokens", 1)
        _at_least(self, "num_replicas", 1)
        _at_least(self, "stream_interval", 1)


class PipelineConfig(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """The whole pipeline: what a Serve config's ``args:`` holds."""

    name: str = "default"  # the coordinator's name in namespace moriio_ray
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    transfer: TransferConfig = msgspec.field(default_factory=TransferConfig)
    pool: PoolConfig = msgspec.field(default_factory=PoolConfig)
    runtime: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    serve: ServeConfig = msgspec.field(default_factory=ServeConfig)

    def __post_init__(self) -> None:
        if not _LABEL.match(self.name):
            raise ConfigError(f"name: {self.name!r} may hold only letters, digits and _.-/")
        if self.model.preset == SIM:
            if self.transfer.backend in ("cuda_ipc", "mori"):
                raise ConfigError(
                    f"transfer.backend: {self.transfer.backend!r} moves GPU memory, and the simulated model "
                    "(model.preset: sim) keeps its KV cache in CPU memory; use shm or tcp"
                )
            for role in ("prefill", "decode", "colocated"):
                rc: RoleConfig = getattr(self.pool, role)
                if rc.replicas > 0 and rc.tensor_parallel_size > 1:
                    raise ConfigError(
                        f"pool.{role}.tensor_parallel_size: {rc.tensor_parallel_size}: the simulated model "
                        "(model.preset: sim) runs one rank per engine; set 1"
                    )

    @property
    def mode(self) -> str:
        """``colocated`` for a colocated pool, else the transfer mode (``read`` or ``write``)."""
        return "colocated" if self.pool.colocated.replicas > 0 else self.transfer.mode
