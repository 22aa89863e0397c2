"""One step's work: every running decode first, then prefill chunks, in one forward pass.

Row ``i`` of a ``Batch`` feeds ``q_lens[i]`` new tokens after the ``num_cached`` tokens its sequence
already has in the cache: 1 for a decode, a chunk of its prompt (or of its tokens, recomputing) for
a prefill. A row samples when its new tokens reach the last known token; a prefill chunk short of
that only fills the cache. ``PrefillChunk`` tells the layer hook what each prefill row computed.
"""

from __future__ import annotations

import dataclasses

import msgspec

from moriio_ray.engine.sequence import Sequence, blocks_for


class PrefillChunk(msgspec.Struct, frozen=True, array_like=True):
    """What one step computed of a prompt: its tokens ``[start, end)`` (the layer hook's argument).

    A WRITE push sends, per layer, the blocks this chunk completed (``ready_blocks``): each block
    goes once, whole, after its last token was written; the prompt's last (partial) block goes with
    the last chunk.
    """

    request_id: str
    start: int  # tokens cached before this step
    end: int  # tokens cached after it
    num_prompt_tokens: int

    @property
    def is_last(self) -> bool:
        """This chunk completes the prompt."""
        return self.end >= self.num_prompt_tokens

    def ready_blocks(self, block_size: int) -> tuple[int, int]:
        """[first, end) indices into the prompt's blocks that hold their final K/V after this step
        and did not before it (empty when the chunk completes no block)."""
        end = min(self.end, self.num_prompt_tokens)
        last = blocks_for(end, block_size) if end >= self.num_prompt_tokens else end // block_size
        return min(self.start // block_size, last), last


@dataclasses.dataclass
class Batch:
    """The rows of one forward pass: decodes (one token each) first, then prefill chunks."""

    seqs: list[Sequence]
    q_lens: list[int]  # new tokens per row
    num_decodes: int  # rows [0, num_decodes) are decodes
    # the tokens each row feeds, when the sequences do not hold them (a tensor-parallel follower)
    fed: list[list[int]] | None = None
    chunks: list[PrefillChunk] | None = None  # a follower's copy of rank 0's prefill chunks

    @classmethod
    def decode(cls, seqs: list[Sequence]) -> Batch:
        """Every sequence decodes its last token."""
        return cls(list(seqs), [1] * len(seqs), len(seqs))

    @classmethod
    def prefill(cls, seqs: list[Sequence]) -> Batch:
        """Every sequence feeds all its uncached tokens in one chunk."""
        return cls(list(seqs), [s.num_ahead - s.num_cached for s in seqs], 0)

    @property
    def is_decode(self) -> bool:
        """A pure decode step (what the CUDA graphs replay)."""
        return self.num_decodes == len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    def samples(self) -> list[bool]:
        """Per row: whether its new tokens reach its last token, so that it samples the next one."""
        return [s.num_cached + n == s.num_ahead for s, n in zip(self.seqs, self.q_lens, strict=True)]

    def prefill_chunks(self) -> list[PrefillChunk]:
        """The prefill rows' chunks, in row order."""
        if self.chunks is not None:
            return self.chunks
        rows = range(self.num_decodes, len(self.seqs))
        return [
            PrefillChunk(
                self.seqs[i].request_id,
                self.seqs[i].num_cached,
                self.seqs[i].num_cached + self.q_lens[i],
                self.seqs[i].num_prompt_tokens,
            )
            for i in rows
        ]
