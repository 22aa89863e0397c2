"""Prefix cache: full KV blocks found again by the tokens they hold.

A full block's key is a hash of its parent block's key and its own token ids, so a key names the
whole prefix up to the block's end: two requests that share the first ``k`` blocks of tokens share
their first ``k`` keys, on any engine and on every tensor-parallel rank (the keys come from tokens
alone; rank 0 picks the block ids, and each rank's cache holds its KV heads of the same block).

``PrefixCache`` maps keys to block ids for the ``BlockAllocator``, which owns the blocks. A block
is registered only once its KV is completely computed (or transferred in); a registered block that
no sequence or lease references any more is *parked*: free to hand out again, but kept with its KV
until it is evicted, least recently parked first. A referenced block (held by a sequence, a lease,
or a quarantined request) is never parked, hence never evicted; and no sequence ever writes into a
block it found in the cache, since a hit covers only full blocks before the token it feeds next.
"""

from __future__ import annotations

import collections
import hashlib
from array import array

BlockKey = bytes  # 16 bytes of BLAKE2b
ROOT_KEY: BlockKey = b""  # the parent of a sequence's first block


def block_keys(tokens: list[int], block_size: int, parent: BlockKey = ROOT_KEY) -> list[BlockKey]:
    """The keys of the full blocks of ``tokens`` (a partial last block has none), chained from
    ``parent`` (the key of the block before ``tokens[0]``)."""
    keys: list[BlockKey] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        ids = array("q", tokens[start : start + block_size]).tobytes()
        parent = hashlib.blake2b(parent + ids, digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """Key <-> block id for registered blocks, and the parked ones in eviction order."""

    def __init__(self) -> None:
        self._block_of: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        self._parked: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first

    def __len__(self) -> int:
        """Registered blocks (referenced or parked)."""
        return len(self._block_of)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def is_registered(self, block_id: int) -> bool:
        return block_id in self._key_of

    def is_parked(self, block_id: int) -> bool:
        return block_id in self._parked

    def match(self, keys: list[BlockKey]) -> list[int]:
        """The blocks of the longest prefix of ``keys`` that the cache holds."""
        blocks: list[int] = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def register(self, block_id: int, key: BlockKey) -> bool:
        """Map ``key`` to ``block_id`` (a referenced block whose KV is complete); False when the key
        already names another block (the duplicate stays unregistered) or the block has a key."""
        if key in self._block_of or block_id in self._key_of:
            return False
        self._block_of[key] = block_id
        self._key_of[block_id] = key
        return True

    def park(self, block_id: int) -> None:
        """A registered block lost its last reference: keep it, newest last in eviction order."""
        self._parked[block_id] = None

    def unpark(self, block_id: int) -> None:
        """A parked block is referenced again (a hit)."""
        del self._parked[block_id]

    def evict(self) -> int:
        """Forget the least recently parked block; its id, free to be written."""
        block_id, _ = self._parked.popitem(last=False)
        del self._block_of[self._key_of.pop(block_id)]
        return block_id
