"""Incremental detokenization with stop-string handling, for streams and final results."""

from __future__ import annotations

from typing import Protocol


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
        self.sent = 0  # characters of the text already emitted
        self.text = ""

    def add(self, token_ids: list[int], *, final: bool) -> str:
        """Append tokens; return the new text that is safe to emit."""
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids)
        cut = self._stop_at(text)
        if cut is not None:
            text, final = text[:cut], True
        self.text = text
        limit = len(text)
        if not final:
            if text.endswith("\ufffd"):
                limit -= 1
            limit = max(self.sent, limit - self._hold) if self.stop else limit
        delta = text[self.sent : limit]
        self.sent = max(self.sent, limit)
        return delta

    def _stop_at(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None
