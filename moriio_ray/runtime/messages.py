"""Messages between the pipeline, the coordinator and the workers (msgspec Structs; they pickle for Ray)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import msgspec

from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.transfer.desc import EngineDesc, MemoryDesc
from moriio_ray.transfer.layout import KVLayout


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


class WorkerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker publishes once ready (the coordinator puts it in the object store)."""

    key: str
    role: str
    epoch: int
    node_id: str
    host: str
    pid: int
    backend: str
    engine_desc: EngineDesc
    kv_mem: MemoryDesc | None
    layout: KVLayout
    max_model_len: int
    num_blocks: int
    same_host_only: bool


class GenRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One tokenized request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class KVHandle(msgspec.Struct, frozen=True, kw_only=True):
    """READ mode: what P returns after prefill. D reads ``block_ids`` from P before the lease ends."""

    transfer_id: str
    engine_key: str
    epoch: int
    block_ids: list[int]
    num_tokens: int
    first_token: int
    first_logprob: float | None
    lease_deadline_unix: float
    prefill_done_unix: float
    prefill_s: float
    finished: bool = False  # the first token already ended the request (EOS, stop, max_tokens == 1)
    finish_reason: str | None = None


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    """WRITE mode: the blocks D reserved for a request, which P pushes into."""

    request_id: str
    engine_key: str
    epoch: int
    block_ids: list[int]
    deadline_unix: float


class PushResult(msgspec.Struct, frozen=True, kw_only=True):
    """WRITE mode: what P returns once every layer has landed in D's reserved blocks."""

    request_id: str
    first_token: int
    first_logprob: float | None
    prefill_done_unix: float
    prefill_s: float
    push_wait_s: float  # time P waited for pushes after the last layer was computed
    num_bytes: int
    num_segments: int
    finished: bool = False
    finish_reason: str | None = None


class TokenChunk(msgspec.Struct, kw_only=True):
    """A piece of a request's output stream."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    finished: bool = False
    finish_reason: str | None = None
    timings: dict[str, float] | None = None  # on the last chunk, or the first decode chunk


@dataclass
class Member:
    """A worker as the coordinator and routers see it."""

    key: str
    role: str
    epoch: int
    node_id: str
    actor: Any  # ray ActorHandle
    info_ref: Any  # ObjectRef[WorkerInfo], owned by the coordinator
    same_host_only: bool = False


@dataclass
class Membership:
    """A versioned snapshot of the live workers."""

    version: int
    members: list[Member] = field(default_factory=list)

    def by_role(self, role: str) -> list[Member]:
        return [m for m in self.members if m.role == role]

    def find(self, key: str) -> Member | None:
        for m in self.members:
            if m.key == key:
                return m
        return None
