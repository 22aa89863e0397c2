"""The lean HTTP client's wire format: chunked transfer decoding, SSE events, and the few fields of
a streamed completion chunk that the benchmark reads."""

from __future__ import annotations

from typing import Any

import msgspec


class ProtocolError(Exception):
    """The server's bytes are not the HTTP/1.1 or SSE this client understands."""


class ChunkedDecoder:
    """Incremental ``Transfer-Encoding: chunked`` decoding: feed raw bytes, get body bytes."""

    def __init__(self) -> None:
        self._buf, self._left, self._state = bytearray(), 0, "size"  # size | data | crlf | trailer | done

    @property
    def done(self) -> bool:
        return self._state == "done"

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        out = bytearray()
        while self._state != "done":
            if self._state in ("size", "trailer"):
                end = self._buf.find(b"\r\n")
                if end < 0:
                    break
                line = bytes(self._buf[:end])
                del self._buf[: end + 2]
                if self._state == "trailer":
                    self._state = "trailer" if line else "done"
                    continue
                try:
                    self._left = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size {line!r}") from None
                self._state = "data" if self._left else "trailer"
            elif self._state == "data":
                if not self._buf:
                    break
                take = min(self._left, len(self._buf))
                out += self._buf[:take]
                del self._buf[:take]
                self._left -= take
                self._state = "data" if self._left else "crlf"
            else:  # crlf
                if len(self._buf) < 2:
                    break
                if self._buf[:2] != b"\r\n":
                    raise ProtocolError("a chunk does not end with CRLF")
                del self._buf[:2]
                self._state = "size"
        return bytes(out)


class SSEParser:
    """Incremental server-sent events: feed body bytes, get each complete event's ``data`` (LF or
    CRLF line ends; ``data:`` lines joined with LF; comments and other fields skipped)."""

    def __init__(self) -> None:
        self._buf, self._data = b"", list[bytes]()

    def feed(self, data: bytes) -> list[bytes]:
        *lines, self._buf = (self._buf + data).split(b"\n")
        events: list[bytes] = []
        for raw in lines:
            line = raw[:-1] if raw.endswith(b"\r") else raw
            if not line and self._data:
                events.append(b"\n".join(self._data))
                self._data = []
            elif line.startswith(b"data:"):
                self._data.append(line[6:] if line.startswith(b"data: ") else line[5:])
        return events


class _Logprobs(msgspec.Struct):
    tokens: list[Any] = []


class _Choice(msgspec.Struct):
    logprobs: _Logprobs | None = None


class _Error(msgspec.Struct):
    message: str = ""


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    error: _Error | None = None
    usage: _Usage | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


def read_event(data: bytes) -> tuple[int, int | None]:
    """(tokens, the usage's completion_tokens or None) of one stream event (``logprobs: 0`` lists
    the tokens); -1 tokens for ``[DONE]``; a ProtocolError carrying the message of an error event."""
    if data == b"[DONE]":
        return -1, None
    try:
        chunk = _decode_chunk(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"an event is not a completion chunk: {exc}") from None
    if chunk.error is not None:
        raise ProtocolError(f"error event: {chunk.error.message}")
    used = None if chunk.usage is None else chunk.usage.completion_tokens
    if not chunk.choices or chunk.choices[0].logprobs is None:
        return 0, used
    return len(chunk.choices[0].logprobs.tokens), used


def tokens_in_event(data: bytes) -> int:
    return read_event(data)[0]
