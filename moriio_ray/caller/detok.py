"""Incremental detokenization on the caller, with stop-string handling, for streams and results.

Each chunk decodes only a short window of tokens (the new ones, after the previous chunk's tokens
for context), not the whole output, so a request costs O(tokens), not O(tokens^2). The last chunk
checks the result against one full decode, so a final text equals ``tokenizer.decode`` exactly.
"""

from __future__ import annotations

from typing import Protocol

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class IncrementalText:
    """Turns a growing token list into text deltas.

    Holds back an incomplete UTF-8 character (decoded as U+FFFD) and, while stop strings are set,
    the tail that could still become one, so that no stop string ever reaches the client.
    """

    def __init__(self, tokenizer: Decoder, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # the text of token_ids[:_read] (cut at a stop string once one is found)
        self.sent = 0  # characters of the text already emitted
        self.stopped = False  # a stop string was found: nothing more is emitted
        self._prefix = 0  # the window decoded next starts here, for context
        self._read = 0  # tokens already in self.text

    def add(self, token_ids: list[int], *, final: bool) -> str:
        """Append tokens; return the new text that is safe to emit."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        searched = max(0, len(self.text) - self._hold)
        self._extend(final)
        if final and not self.stop:
            full = self.tokenizer.decode(self.token_ids)
            if full.startswith(self.text[: self.sent]):
                self.text = full
        cut = self._stop_at(searched)
        if cut is not None:
            self.text, final, self.stopped = self.text[:cut], True, True
        limit = len(self.text)
        if not final and self.stop:
            limit = max(self.sent, limit - self._hold)
        delta = self.text[self.sent : limit]
        self.sent = max(self.sent, limit)
        return delta

    def _extend(self, final: bool) -> None:
        ids = self.token_ids
        if self._read == len(ids):
            return
        before = self.tokenizer.decode(ids[self._prefix : self._read])
        window = self.tokenizer.decode(ids[self._prefix :])
        if not final and window.endswith(_REPLACEMENT):
            return  # an incomplete character: wait for the next token
        if len(window) >= len(before) and window.startswith(before):
            self.text += window[len(before) :]
        else:  # the context changed how earlier tokens decode (rare): fall back to a full decode
            self.text = self.tokenizer.decode(ids)
        self._prefix, self._read = self._read, len(ids)

    def _stop_at(self, start: int) -> int | None:
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(found) if found else None
