"""KV transfers between tensor-parallel engines: one batched transfer per (local rank, remote rank).

``plan_pulls`` maps a request's blocks to each local rank's reads: every pair of ranks that share
KV heads (``plan.rank_pairs``) gets one plan and one ``agent.read``. Rank 0 (the worker) issues its
own; the other ranks issue theirs in their processes (``RankWorker.read``). ``GroupTransfer`` is
the one handle over all of them, so that the decode side waits on, or quarantines behind, a group
read exactly as behind a single one.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from typing import Any

from moriio_ray.errors import MoriioRayError, PeerLost, TransferError, TransferTimeout
from moriio_ray.protocol.messages import RankDesc
from moriio_ray.transfer.base import TransferAgent
from moriio_ray.transfer.desc import MemoryDesc
from moriio_ray.transfer.handle import Transfer
from moriio_ray.transfer.plan import PullItem, plan_blocks, rank_pairs
from moriio_ray.worker.ranks import RankGroup


def plan_pulls(
    local_ranks: Sequence[RankDesc],
    remote_ranks: Sequence[RankDesc],
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
) -> dict[int, list[PullItem]]:
    """Each local rank's reads: one item per remote rank holding some of its KV heads."""
    pulls: dict[int, list[PullItem]] = {}
    local_layouts = [r.layout for r in local_ranks]
    for i, j in rank_pairs(local_layouts, [r.layout for r in remote_ranks]):
        remote = remote_ranks[j]
        plan = plan_blocks(local_blocks, remote_blocks, local_layouts[i], remote.layout)
        pulls.setdefault(local_ranks[i].rank, []).append(PullItem(remote.engine_desc, remote.kv_mem, plan))
    return pulls


def issue_reads(
    agent: TransferAgent, local_mem: MemoryDesc, items: Sequence[PullItem], *, connect: bool = True
) -> list[Transfer]:
    """Start every item's read on ``agent``; ``connect`` first to a rank not yet connected (once per
    pair: connect is idempotent). Rank 0's peer directory has connected its ranks already."""
    transfers = []
    for item in items:
        if connect:
            agent.connect(item.peer)
        transfers.append(agent.read(local_mem, item.remote_mem, item.plan))
    return transfers


def wait_all(transfers: Sequence[Transfer], timeout_s: float) -> None:
    """Wait for every transfer within one deadline (blocking); the first failure is raised."""
    deadline = time.monotonic() + timeout_s
    for xfer in transfers:
        xfer.wait(max(0.0, deadline - time.monotonic()))


class GroupTransfer(Transfer):
    """Rank 0's own transfers plus the other ranks' (Ray calls returning their byte counts)."""

    def __init__(self, local: list[Transfer], remote: list[Any], num_bytes: int, num_segments: int) -> None:
        self.local = local
        # the RankWorker.read calls, as futures: polled and waited on from any thread, no ray.get
        self.remote: list[concurrent.futures.Future[Any]] = [ref.future() for ref in remote]
        self.num_bytes = num_bytes
        self.num_segments = num_segments
        self.peer_key = ",".join(sorted({x.peer_key for x in local})) or "tp ranks"

    def done(self) -> bool:
        return all(x.done() for x in self.local) and all(f.done() for f in self.remote)

    def wait(self, timeout_s: float | None = None) -> None:
        import ray

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for xfer in self.local:
            xfer.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        _, pending = concurrent.futures.wait(self.remote, timeout=left)
        if pending:
            raise TransferTimeout(
                f"the tensor-parallel ranks' reads ({self.num_bytes} bytes in all) did not finish "
                f"within {timeout_s} s"
            )
        try:
            for fut in self.remote:
                fut.result()
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, MoriioRayError):
                raise cause from None
            raise TransferError(f"a tensor-parallel rank's read failed: {cause!r}") from None
        except ray.exceptions.RayActorError as exc:
            raise PeerLost(f"a tensor-parallel rank of this engine died during a read: {exc}") from None


def start_pull(
    agent: TransferAgent,
    local_mem: MemoryDesc,
    pulls: dict[int, list[PullItem]],
    group: RankGroup | None,
    timeout_s: float,
) -> Transfer:
    """Issue every rank's reads of one request (rank 0 here, the others through ``group``); one handle.

    P and D at TP = 1 make one item: its read's own handle is returned (nothing else happens)."""
    own = pulls.get(0, [])
    if group is None and len(own) == 1 and len(pulls) == 1:
        return issue_reads(agent, local_mem, own, connect=False)[0]
    local = issue_reads(agent, local_mem, own, connect=False)
    remote = group.read(pulls, timeout_s) if group is not None else []
    items = [item for rank_items in pulls.values() for item in rank_items]
    num_bytes = sum(i.plan.num_bytes for i in items)
    return GroupTransfer(local, remote, num_bytes, sum(i.plan.num_segments for i in items))
