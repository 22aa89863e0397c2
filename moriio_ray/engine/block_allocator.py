"""BlockAllocator: reference-counted KV blocks, and leases that pin blocks for a transfer.

Counters are exact at every moment: ``num_free + num_used == num_blocks``, and ``num_leased`` counts
the used blocks that at least one lease holds. A lease is one reference per block, so a block is
freed only when its sequence and every lease holding it have let go.
"""

from __future__ import annotations

import collections
import dataclasses

from moriio_ray.errors import CapacityError, InvalidRequest


@dataclasses.dataclass(frozen=True)
class Lease:
    """Blocks pinned for ``transfer_id`` until ``deadline_s`` (time.monotonic based)."""

    transfer_id: str
    block_ids: tuple[int, ...]
    deadline_s: float


class BlockAllocator:
    """Hands out block ids 0..num_blocks-1 with reference counts and leases."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise CapacityError(f"num_blocks: {num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._lease_refs = [0] * num_blocks
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        self._leases: dict[str, Lease] = {}
        self._num_leased = 0

    # -- counters -----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_leased(self) -> int:
        return self._num_leased

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    # -- blocks -------------------------------------------------------------------------------

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` free blocks, each with one reference; CapacityError if fewer are free."""
        if num_blocks > len(self._free):
            raise CapacityError(
                f"need {num_blocks} KV blocks, only {len(self._free)} are free; retry after a step"
            )
        ids = [self._free.popleft() for _ in range(num_blocks)]
        for i in ids:
            self._refs[i] = 1
        return ids

    def free(self, block_ids: list[int] | tuple[int, ...]) -> None:
        """Drop one reference from each block; a block with none left becomes free."""
        for i in block_ids:
            assert self._refs[i] > 0, f"block {i} freed more often than referenced"
            self._refs[i] -= 1
            if self._refs[i] == 0:
                self._free.append(i)

    # -- leases -------------------------------------------------------------------------------

    def lease(self, transfer_id: str, block_ids: list[int], deadline_s: float) -> Lease:
        """Pin ``block_ids`` (one more reference each) for ``transfer_id`` until ``deadline_s``."""
        if transfer_id in self._leases:
            raise InvalidRequest(f"transfer_id {transfer_id!r} already holds a lease; use a unique id")
        for i in block_ids:
            assert self._refs[i] > 0, f"block {i} is free and cannot be leased"
            self._refs[i] += 1
            self._lease_refs[i] += 1
            if self._lease_refs[i] == 1:
                self._num_leased += 1
        lease = Lease(transfer_id, tuple(block_ids), deadline_s)
        self._leases[transfer_id] = lease
        return lease

    def get_lease(self, transfer_id: str) -> Lease | None:
        return self._leases.get(transfer_id)

    def release(self, transfer_id: str) -> bool:
        """Drop a lease and its references; False if ``transfer_id`` holds none (idempotent)."""
        lease = self._leases.pop(transfer_id, None)
        if lease is None:
            return False
        for i in lease.block_ids:
            self._lease_refs[i] -= 1
            if self._lease_refs[i] == 0:
                self._num_leased -= 1
        self.free(lease.block_ids)
        return True

    def sweep(self, now_s: float, grace_s: float) -> list[str]:
        """Release every lease whose deadline plus ``grace_s`` lies before ``now_s``; their ids."""
        expired = [t for t, lease in self._leases.items() if lease.deadline_s + grace_s < now_s]
        for transfer_id in expired:
            self.release(transfer_id)
        return expired
