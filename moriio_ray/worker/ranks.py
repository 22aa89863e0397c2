"""Rank 0's driver of a tensor-parallel engine's other ranks (``RankWorker`` actors).

Rank 0 is the worker itself (``WorkerCore``): it schedules and broadcasts each step (in the engine,
``tp_steps``). This group object does the rest of rank 0's side: it hosts the rendezvous store on an
ephemeral port and joins the process group with the other ranks, collects their descriptors for
the membership entry, hands each rank its share of a READ pull or a WRITE push, and forwards a
dead peer's ranks to them. At TP = 1 a worker has no group and none of this runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from moriio_ray.config import PipelineConfig
from moriio_ray.engine.tp import SINGLE, TPGroup, init_group
from moriio_ray.protocol.deadline import deadline
from moriio_ray.protocol.messages import RankDesc
from moriio_ray.transfer.plan import PullItem
from moriio_ray.worker.push import PushOrder

log = logging.getLogger(__name__)

_STORE_TIMEOUT = timedelta(seconds=300)
_LOCALHOST = "127.0.0.1"  # the ranks of one engine share a node (one bundle)


def open_group(
    config: PipelineConfig, role: Any, followers: Sequence[Any] | None
) -> tuple[RankGroup | None, TPGroup]:
    """Rank 0's group and its place in it; (None, SINGLE) at TP = 1 (``followers`` empty)."""
    if not followers:
        return None, SINGLE
    from moriio_ray.engine.device import resolve_device
    from moriio_ray.engine.loader import model_args
    from moriio_ray.engine.tp_size import check_tp_size

    size = len(followers) + 1
    check_tp_size(model_args(config.model), size, f"pool.{role.value}.tensor_parallel_size")
    group = RankGroup(followers, config.runtime.worker_start_timeout_s)
    return group, group.open(resolve_device(config.engine.device))


def end_process(exc: BaseException) -> None:
    """A rank's group broke (a peer rank died): end this process now, so that the engine is dead
    as a whole; callers and the coordinator then apply the rules for a dead worker."""
    log.error("the tensor-parallel group broke (%r): ending this rank's process", exc)
    logging.shutdown()
    os._exit(70)


def close_group(engine: Any) -> None:
    """Rank 0 is closing: the other ranks leave their loops (a broken group is past caring)."""
    try:
        engine.close()
    except Exception:  # a peer rank already died: its collective fails, and it is gone anyway
        pass


class RankGroup:
    """The other ranks of rank 0's engine (``followers[i]`` is rank i + 1)."""

    def __init__(self, followers: Sequence[Any], timeout_s: float) -> None:
        self.followers = list(followers)
        self.size = len(self.followers) + 1
        self.timeout_s = timeout_s
        self._joins: list[Any] = []
        self._store: Any = None
        self._descs: list[RankDesc] | None = None

    def open(self, device: Any) -> TPGroup:
        """Host the store, ask every rank to join, and join as rank 0 (blocks until all have)."""
        import torch.distributed as dist

        self._store = dist.TCPStore(
            _LOCALHOST, 0, is_master=True, wait_for_workers=False, timeout=_STORE_TIMEOUT
        )
        self._joins = [f.join.remote(_LOCALHOST, self._store.port) for f in self.followers]
        return init_group(0, self.size, self._store, device, on_broken=end_process)

    async def descs(self) -> list[RankDesc]:
        """Ranks 1.. once built (their models load while rank 0 builds its own)."""
        if self._descs is None:
            got = await asyncio.gather(
                *(
                    deadline(ref, self.timeout_s, f"tensor-parallel rank {i + 1}")
                    for i, ref in enumerate(self._joins)
                )
            )
            self._descs = list(got)
        return self._descs

    # -- transfers ------------------------------------------------------------------------------

    def read(self, pulls: dict[int, list[PullItem]], timeout_s: float) -> list[Any]:
        """Start each rank's reads (ranks other than 0); their ObjectRefs (bytes moved each)."""
        return [
            self.followers[rank - 1].read.remote(items, timeout_s) for rank, items in pulls.items() if rank
        ]

    async def prepare_push(
        self,
        request_id: str,
        peer_ranks: list[RankDesc],
        dest_blocks: list[int],
        last_push_unix: float,
        first_block: int = 0,
    ) -> None:
        """Every other rank prepares its push of ``request_id`` (``PushOrder``)."""
        order = PushOrder(request_id, peer_ranks, dest_blocks, last_push_unix, first_block)
        pushes = [f.prepare_push.remote(order) for f in self.followers]
        await asyncio.gather(*(deadline(ref, self.timeout_s, "a push") for ref in pushes))

    async def wait_push(self, request_id: str, timeout_s: float) -> tuple[int, int]:
        """Every other rank's push of ``request_id``: (bytes, segments) together."""
        got = await asyncio.gather(
            *(
                deadline(f.wait_push.remote(request_id, timeout_s), timeout_s + self.timeout_s, "a push")
                for f in self.followers
            )
        )
        return sum(b for b, _ in got), sum(s for _, s in got)

    async def settle_push(self, request_id: str, timeout_s: float) -> bool:
        """Every other rank starts no more pushes of ``request_id`` and waits for those started;
        True when none of them can land any more."""
        try:
            settled = await asyncio.gather(
                *(
                    deadline(
                        f.settle_push.remote(request_id, timeout_s), timeout_s + self.timeout_s, "a push"
                    )
                    for f in self.followers
                )
            )
        except Exception as exc:  # a rank that died pushes no more; one that does not answer might
            log.warning("could not settle the pushes of %s on every rank: %r", request_id, exc)
            return False
        return all(settled)

    def lost(self, keys: list[str]) -> None:
        """A peer engine died: every rank drops its ranks (their transfers fail with PeerLost)."""
        for f in self.followers:
            f.peer_lost.remote(keys)
