"""The names and the GCS record that let a pool outlive its coordinator's process.

What a coordinator keeps in Ray's GCS key-value store, so that Ray can restart it after its death
and it can take its pool back: the membership version, the placement group's name, and each slot's
epoch and the name of its worker (and its rank actors). The workers and the placement group are
detached and named, so they outlive the coordinator's process; a restarted coordinator finds them by
name, asks each live worker for its descriptors, and replaces the ones that died meanwhile."""

from __future__ import annotations

import msgspec

NAMESPACE = "moriio_ray"  # the pipelines' actors, placement groups and GCS records


class StoredSlot(msgspec.Struct, frozen=True):
    role: str
    index: int
    bundle_index: int
    epoch: int
    worker: str | None  # the worker actor's name (None: no live worker when saved)
    ranks: list[str] = msgspec.field(default_factory=list)  # its rank actors' names (TP > 1)


class Stored(msgspec.Struct, frozen=True):
    version: int
    placement_group: str
    slots: list[StoredSlot]


def _key(pipeline: str) -> bytes:
    return f"coordinator/{pipeline}".encode()


def save(pipeline: str, state: Stored) -> None:
    from ray.experimental import internal_kv  # (Ray only where it is called: this is the protocol)

    internal_kv._internal_kv_put(_key(pipeline), msgspec.msgpack.encode(state), namespace=NAMESPACE)


def load(pipeline: str) -> Stored | None:
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(_key(pipeline), namespace=NAMESPACE)
    return None if raw is None else msgspec.msgpack.decode(raw, type=Stored)


def drop(pipeline: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(_key(pipeline), namespace=NAMESPACE)


def worker_name(pipeline: str, key: str, epoch: int) -> str:
    """A worker actor's name: per epoch, since a replacement starts before its name's holder is gone."""
    return f"worker:{pipeline}:{key}:{epoch}"


def placement_group_name(pipeline: str) -> str:
    return f"moriio_ray:{pipeline}"
