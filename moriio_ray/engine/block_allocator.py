"""BlockAllocator: reference-counted KV blocks, and leases that pin blocks for a transfer.

Counters are exact at every moment: ``num_free + num_used == num_blocks``, and ``num_leased`` counts
the used blocks that at least one lease holds. A lease is one reference per block, so a block is
freed only when its sequence and every lease holding it have let go.

With prefix caching (``prefix_caching=True``) a freed block that holds a registered prefix
(``register``) is parked in the ``PrefixCache`` instead: it counts as free, and ``allocate`` hands it
out only when no unregistered block is left (least recently parked first), until then ``match``
finds it and ``acquire`` references it again. A referenced block is never parked, so never evicted.
"""

from __future__ import annotations

import collections
import dataclasses

from moriio_ray.engine.prefix_cache import BlockKey, PrefixCache
from moriio_ray.errors import CapacityError, InvalidRequest


@dataclasses.dataclass(frozen=True)
class Lease:
    """Blocks pinned for ``transfer_id`` until ``deadline_s`` (time.monotonic based)."""

    transfer_id: str
    block_ids: tuple[int, ...]
    deadline_s: float


class BlockAllocator:
    """Hands out block ids 0..num_blocks-1 with reference counts and leases."""

    def __init__(self, num_blocks: int, *, prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise CapacityError(f"num_blocks: {num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._lease_refs = [0] * num_blocks
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        self._leases: dict[str, Lease] = {}
        self._num_leased = 0
        self.cache: PrefixCache | None = PrefixCache() if prefix_caching else None

    # -- counters -----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` may hand out: unregistered free ones and parked cached ones."""
        return len(self._free) + (self.cache.num_parked if self.cache is not None else 0)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_leased(self) -> int:
        return self._num_leased

    def ref_count(self, block_id: int) -> int:
        # (read by tests/unit/test_kv_cache.py: a shared block's count is the sharing's observable)
        return self._refs[block_id]

    # -- blocks -------------------------------------------------------------------------------

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` free blocks, each with one reference; CapacityError if fewer are free.
        Unregistered blocks go first; then parked cached blocks are evicted, oldest first."""
        if num_blocks > self.num_free:
            raise CapacityError(
                f"need {num_blocks} KV blocks, only {self.num_free} are free; retry after a step"
            )
        ids = [self._free.popleft() if self._free else self._evict() for _ in range(num_blocks)]
        for i in ids:
            self._refs[i] = 1
        return ids

    def _evict(self) -> int:
        assert self.cache is not None, "no free block and no cache to evict from"
        return self.cache.evict()

    def free(self, block_ids: list[int] | tuple[int, ...]) -> None:
        """Drop one reference from each block; a block with none left becomes free (parked, if it
        holds a registered prefix: pass a sequence's blocks last first, so its tail goes first)."""
        for i in block_ids:
            assert self._refs[i] > 0, f"block {i} freed more often than referenced"
            self._refs[i] -= 1
            if self._refs[i] == 0:
                if self.cache is not None and self.cache.is_registered(i):
                    self.cache.park(i)
                else:
                    self._free.append(i)

    # -- prefix cache -------------------------------------------------------------------------

    def match(self, keys: list[BlockKey]) -> list[int]:
        """The cached blocks of the longest prefix of ``keys`` (none without prefix caching)."""
        return self.cache.match(keys) if self.cache is not None else []

    def acquire_cost(self, block_ids: list[int]) -> int:
        """Free blocks that referencing ``block_ids`` (cache hits) takes: the parked ones."""
        cache = self.cache
        return 0 if cache is None else sum(cache.is_parked(i) for i in block_ids)

    def acquire(self, block_ids: list[int]) -> None:
        """One more reference on each of ``block_ids`` (cached blocks a sequence found)."""
        for i in block_ids:
            if self._refs[i] == 0:
                assert self.cache is not None and self.cache.is_parked(i), f"block {i} is free"
                self.cache.unpark(i)
            self._refs[i] += 1

    def register(self, block_id: int, key: BlockKey) -> None:
        """``block_id`` (referenced) holds the complete KV of the prefix ``key`` names."""
        assert self._refs[block_id] > 0, f"block {block_id} is free and cannot be registered"
        if self.cache is not None:
            self.cache.register(block_id, key)

    @property
    def num_cached(self) -> int:
        """Registered blocks, referenced or parked."""
        return len(self.cache) if self.cache is not None else 0

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
