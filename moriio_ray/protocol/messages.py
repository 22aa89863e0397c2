"""Messages between the caller, the coordinator and the workers.

msgspec Structs: they pickle for Ray, and the output stream sends them as msgpack bytes. This module
imports neither torch nor Ray, so that the Serve ingress and the coordinator stay light: neither
loads torch (``tests/unit/test_registry.py`` checks the coordinator).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import msgspec

from moriio_ray import errors
from moriio_ray.engine.outputs import PromptLogprobs, StepOutput
from moriio_ray.engine.sampling import SamplingParams
from moriio_ray.transfer.desc import EngineDesc, MemoryDesc
from moriio_ray.transfer.layout import KVLayout


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


class RankDesc(msgspec.Struct, frozen=True, kw_only=True):
    """One tensor-parallel rank of an engine: its agent, its KV region and which KV heads it holds
    (``layout.heads``). Rank 0 is the worker itself."""

    rank: int
    engine_desc: EngineDesc
    kv_mem: MemoryDesc
    layout: KVLayout


class WorkerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker publishes once ready (the coordinator puts it in the object store).

    ``engine_desc``, ``kv_mem`` and ``layout`` are rank 0's; ``ranks`` lists every rank of a
    tensor-parallel engine (rank 0 included) and is empty at TP = 1.
    """

    key: str
    role: Role
    epoch: int
    engine_desc: EngineDesc  # node, host, pid and backend live here, once
    kv_mem: MemoryDesc | None
    layout: KVLayout
    max_model_len: int
    vocab_size: int
    same_host_only: bool
    ranks: list[RankDesc] = msgspec.field(default_factory=list)

    def rank_descs(self) -> list[RankDesc]:
        """Every rank's descriptors (one entry, rank 0, at TP = 1)."""
        if self.ranks:
            return list(self.ranks)
        if self.kv_mem is None:
            raise errors.TransferError(f"peer {self.key!r} published no KV region")
        return [RankDesc(rank=0, engine_desc=self.engine_desc, kv_mem=self.kv_mem, layout=self.layout)]


class GenRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One tokenized, validated request (``PDPipeline.make_request`` builds it, seed drawn)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # output positions produced before this attempt (a continuation after a worker death): the
    # seeded sampler draws from this position on, so a moved request keeps its tokens
    sample_offset: int = 0


class Prefilled(msgspec.Struct, frozen=True, kw_only=True):
    """What P's reply to the caller carries in either mode: the first token, sampled on P."""

    first_token: int
    first_logprob: float | None
    first_top_logprobs: list[tuple[int, float]] | None = None  # the first token's alternatives
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None  # set: the first token already ended the request
    num_cached_tokens: int = 0  # prompt tokens P found in its prefix cache (not computed)
    prefill_done_unix: float
    prefill_s: float


class KVHandle(Prefilled, frozen=True, kw_only=True, tag=True):
    """READ mode: what P returns after prefill. D reads ``block_ids`` from P before the lease ends."""

    transfer_id: str
    engine_key: str
    epoch: int
    block_ids: list[int]  # empty when the first token already ended the request (nothing leased)
    num_tokens: int
    lease_deadline_unix: float


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    """WRITE mode: the blocks D reserved for a request, which P pushes into."""

    request_id: str
    engine_key: str
    epoch: int
    block_ids: list[int]
    deadline_unix: float
    num_cached_blocks: int = 0  # the first blocks already hold the prompt's KV (D's prefix cache)


class PushResult(Prefilled, frozen=True, kw_only=True, tag=True):
    """WRITE mode: what P returns once every layer has landed in D's reserved blocks."""

    request_id: str
    push_wait_s: float  # time P waited for pushes after the last layer was computed
    num_bytes: int
    num_segments: int


Handoff = KVHandle | PushResult  # what P hands to D


class PeerRef(msgspec.Struct, frozen=True, array_like=True):
    """A worker named by key and epoch (a peer resolves it once through the coordinator and
    caches it, instead of deserializing an actor handle in every call)."""

    key: str
    epoch: int


class DecodeStart(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """D's hand-over timings of a request, sent with its first output on D's stream."""

    handoff_unix: float  # P's result reached D
    decode_start_unix: float = 0.0  # the request joined D's batch
    transfer_s: float = 0.0  # READ: D's KV read
    transfer_bytes: int = 0
    transfer_segments: int = 0
    recomputed: bool = False  # the read failed or ran late and D computed the prompt itself


class RequestOutput(msgspec.Struct, array_like=True):
    """New tokens of one request (or its end, or its error) on a worker's output stream."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None  # set on the last output of a request
    error: tuple[str, str] | None = None  # (typed error class name, message): the request failed
    num_cached_tokens: int = 0  # colocated, on the first output: prompt tokens found cached
    # per token, its alternatives (token id, raw log probability), most likely first
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with the first token, when the request asked
    start: DecodeStart | None = None  # D, on a request's first output: its hand-over timings

    @classmethod
    def of_step(cls, request_id: str, out: StepOutput) -> RequestOutput:
        """An engine step's output of one request (its error travels separately)."""
        return cls(
            request_id,
            out.new_token_ids,
            out.logprobs,
            out.finish_reason,
            top_logprobs=out.top_logprobs,
            prompt_logprobs=out.prompt_logprobs,
            num_cached_tokens=out.num_cached_tokens,
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def raise_error(self) -> None:
        if self.error is not None:
            raise error_from(*self.error)


class OutputBatch(msgspec.Struct, array_like=True):
    """One message of a (caller, worker) output stream: every output ready for that caller."""

    items: list[RequestOutput]


def error_from(type_name: str, message: str) -> errors.MoriioRayError:
    """The typed error a worker reported by class name (MoriioRayError for an unknown name)."""
    cls = getattr(errors, type_name, None)
    if isinstance(cls, type) and issubclass(cls, errors.MoriioRayError):
        return cls(message)
    return errors.MoriioRayError(f"{type_name}: {message}")


class Timings(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Where one request's time went, in seconds (None: not measured on this path)."""

    ttft_s: float | None = None  # the caller's send -> first token
    total_s: float | None = None  # the caller's send -> last token
    prefill_s: float | None = None  # P: prefill admitted -> first token sampled
    transfer_s: float | None = None  # READ: D's KV read
    transfer_bytes: int | None = None
    transfer_segments: int | None = None
    push_wait_s: float | None = None  # WRITE: P waiting for its pushes after the last layer
    handoff_s: float | None = None  # P's first token -> D decoding, less the raw transfer
    handoff_rpc_s: float | None = None  # of which: P's result travelling to D
    handoff_local_s: float | None = None  # of which: D's own work around the transfer
    recomputed: bool = False
    cached_tokens: int | None = None  # prompt tokens the prefilling engine found in its prefix cache

    def add_handoff(self, prefill_done_unix: float, start: DecodeStart) -> None:
        """Split the time between P's first token and D's first step into its parts."""
        raw_s = start.transfer_s + (self.push_wait_s or 0.0)
        self.handoff_s = max(0.0, start.decode_start_unix - prefill_done_unix - raw_s)
        self.handoff_local_s = max(0.0, start.decode_start_unix - start.handoff_unix - start.transfer_s)
        self.handoff_rpc_s = max(0.0, self.handoff_s - self.handoff_local_s)
        if start.transfer_bytes:
            self.transfer_s = start.transfer_s
            self.transfer_bytes = start.transfer_bytes
            self.transfer_segments = start.transfer_segments
        self.recomputed = start.recomputed


class Member:
    """A worker as the coordinator and routers see it.

    Cheap to send, since every watcher of the pool receives every member: its descriptors travel
    as msgpack bytes (decoded on first use), and its actor as its name (looked up on first use; the
    workers are named). At 1,000 engines a pickled ActorHandle and a nested Struct per member made
    a snapshot cost the coordinator about 40 ms (``bench/control_plane.py``)."""

    FIELDS = ("key", "role", "epoch", "node_id", "actor_name", "info_data", "same_host_only")  # sent
    __slots__ = (*FIELDS, "_actor", "_info")

    def __init__(
        self,
        key: str,
        role: str,
        epoch: int,
        node_id: str,
        actor_name: str,
        info_data: bytes,
        same_host_only: bool = False,
        *,
        actor: Any = None,
        info: WorkerInfo | None = None,
    ) -> None:
        self.key, self.role, self.epoch, self.node_id = key, role, epoch, node_id
        self.actor_name, self.info_data, self.same_host_only = actor_name, info_data, same_host_only
        self._actor, self._info = actor, info

    @classmethod
    def of(cls, info: WorkerInfo, *, role: str, epoch: int, actor: Any, actor_name: str) -> Member:
        """A member for a ready worker (its handle kept in this process)."""
        data = msgspec.msgpack.encode(info)
        node = info.engine_desc.node_id
        return cls(info.key, role, epoch, node, actor_name, data, info.same_host_only, actor=actor, info=info)

    @property
    def info(self) -> WorkerInfo:
        """Its descriptors."""
        if self._info is None:
            self._info = msgspec.msgpack.decode(self.info_data, type=WorkerInfo)
        return self._info

    @property
    def actor(self) -> Any:
        """Its actor handle (Ray's; a lookup by name the first time in a process). An actor that is
        gone raises ``ActorDiedError``, as a call to its handle would."""
        if self._actor is None:
            import ray

            from moriio_ray.protocol.pool_state import NAMESPACE

            try:
                self._actor = ray.get_actor(self.actor_name, namespace=NAMESPACE)
            except ValueError:  # no actor has the name any more: it died, as a call to it would say
                raise ray.exceptions.ActorDiedError() from None
        return self._actor

    def __reduce__(self) -> tuple[Any, ...]:  # the handle and the decoded descriptors stay here
        return (Member, tuple(getattr(self, f) for f in self.FIELDS))

    def __repr__(self) -> str:
        return f"Member({self.key!r}, {self.role!r}, epoch={self.epoch}, node={self.node_id[:12]!r})"


@dataclass
class Membership:
    """A versioned snapshot of the live workers, or (``base_version`` >= 0) the change from version
    ``base_version`` to ``version``: ``members`` then holds the members added or replaced, and
    ``removed`` the (key, epoch) of those gone. ``protocol/membership.py`` applies one to the other."""

    version: int
    members: list[Member] = field(default_factory=list)
    base_version: int = -1  # -1: a whole snapshot
    removed: list[tuple[str, int]] = field(default_factory=list)

    @property
    def is_delta(self) -> bool:
        return self.base_version >= 0

    def by_role(self, role: str) -> list[Member]:
        return [m for m in self.members if m.role == role]

    def find(self, key: str) -> Member | None:
        return next((m for m in self.members if m.key == key), None)
