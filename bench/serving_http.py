"""HTTP/1.1 and server-sent events for the serving benchmark's client, parsed incrementally with no
HTTP library: a keep-alive connection, chunked bodies, SSE events, and the token count of one
``/v1/completions`` stream event."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from bench.serving_stats import Record

_READ_BYTES = 1 << 16


class ProtocolError(Exception):
    """The server's bytes are not the HTTP/1.1 or SSE this client understands."""


class ChunkedDecoder:
    """Incremental HTTP/1.1 ``Transfer-Encoding: chunked`` decoding: feed raw bytes, get body bytes."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._left = 0  # bytes still due in the current chunk
        self._state = "size"  # size | data | crlf | trailer | done

    @property
    def done(self) -> bool:
        return self._state == "done"

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        out = bytearray()
        while True:
            if self._state == "size":
                end = self._buf.find(b"\r\n")
                if end < 0:
                    break
                size_text = bytes(self._buf[:end]).split(b";", 1)[0].strip()
                del self._buf[: end + 2]
                try:
                    self._left = int(size_text, 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk size {size_text!r}") from None
                self._state = "data" if self._left else "trailer"
            elif self._state == "data":
                if not self._buf:
                    break
                take = min(self._left, len(self._buf))
                out += self._buf[:take]
                del self._buf[:take]
                self._left -= take
                if not self._left:
                    self._state = "crlf"
            elif self._state == "crlf":
                if len(self._buf) < 2:
                    break
                if self._buf[:2] != b"\r\n":
                    raise ProtocolError("a chunk does not end with CRLF")
                del self._buf[:2]
                self._state = "size"
            elif self._state == "trailer":
                end = self._buf.find(b"\r\n")
                if end < 0:
                    break
                line = self._buf[:end]
                del self._buf[: end + 2]
                if not line:
                    self._state = "done"
            else:  # done: anything after the last chunk belongs to no response
                break
        return bytes(out)


class SSEParser:
    """Incremental server-sent events: feed body bytes, get the ``data`` of each complete event.

    Lines end with LF or CRLF; a blank line ends an event; ``data:`` lines of one event are joined
    with LF; comments (``:``) and other fields are skipped.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        events: list[bytes] = []
        for raw in lines:
            line = raw[:-1] if raw.endswith(b"\r") else raw
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
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


_chunk_decoder = msgspec.json.Decoder(_Chunk)


def tokens_in_event(data: bytes) -> int:
    """How many tokens one ``/v1/completions`` stream event holds (``logprobs: 0`` lists them).

    -1 for the closing ``[DONE]``; a ProtocolError carrying the server's message for an error event.
    """
    return read_event(data)[0]


def read_event(data: bytes) -> tuple[int, int | None]:
    """(tokens, the usage's completion_tokens or None) of one stream event; see ``tokens_in_event``."""
    if data == b"[DONE]":
        return -1, None
    try:
        chunk = _chunk_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"an event is not a completion chunk: {exc}") from None
    if chunk.error is not None:
        raise ProtocolError(f"error event: {chunk.error.message}")
    used = None if chunk.usage is None else chunk.usage.completion_tokens
    if not chunk.choices or chunk.choices[0].logprobs is None:
        return 0, used
    return len(chunk.choices[0].logprobs.tokens), used


class Connection:
    """One keep-alive HTTP/1.1 connection; ``stream`` POSTs a JSON body and yields response body bytes."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def stream(self, path: str, body: bytes) -> tuple[int, AsyncIterator[bytes]]:
        """(status, body pieces as they arrive). Reopens the connection if the server closed it."""
        if self.writer is None or self.writer.is_closing():
            await self.open()
        assert self.reader is not None and self.writer is not None
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        await self.writer.drain()
        raw = await self.reader.readuntil(b"\r\n\r\n")
        status_line, *header_lines = raw.decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise ProtocolError(f"bad status line {status_line!r}")
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            if name:
                headers[name.strip().lower()] = value.strip()
        return int(parts[1]), self._body(headers)

    async def _body(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        assert self.reader is not None
        reader = self.reader
        if headers.get("connection", "").lower() == "close":
            self.reader = None  # not reusable; the next request reconnects
        if "chunked" in headers.get("transfer-encoding", "").lower():
            decoder = ChunkedDecoder()
            while not decoder.done:
                data = await reader.read(_READ_BYTES)
                if not data:
                    raise ProtocolError("the connection closed inside a chunked body")
                piece = decoder.feed(data)
                if piece:
                    yield piece
        elif "content-length" in headers:
            left = int(headers["content-length"])
            while left > 0:
                data = await reader.read(min(left, _READ_BYTES))
                if not data:
                    raise ProtocolError("the connection closed inside the body")
                left -= len(data)
                yield data
        else:
            self.reader = None
            while data := await reader.read(_READ_BYTES):
                yield data
        if self.reader is None and self.writer is not None:
            self.writer.close()
            self.writer = None


async def stream_completion(
    conn: Connection, path: str, index: int, body: bytes, *, check_usage: bool = False
) -> Record:
    """Send one streaming completion and time its tokens (one clock reading per socket read).

    ``check_usage`` (the body asks for ``stream_options.include_usage``): a stream without a usage
    event, or whose usage counts other tokens than its events carried, is an error."""
    rec = Record(index=index, sent_s=time.perf_counter())
    try:
        status, pieces = await conn.stream(path, body)
        rec.status = status
        if status != 200:
            text = b"".join([p async for p in pieces])
            rec.error = text.decode(errors="replace")[:300]
            return rec
        sse = SSEParser()
        used: int | None = None
        async for piece in pieces:
            now = time.perf_counter()
            for event in sse.feed(piece):
                num, usage = read_event(event)
                if num > 0:
                    rec.add_tokens(now, num)
                used = usage if usage is not None else used
        if check_usage and used != rec.num_tokens:
            rec.error = f"usage says {used} completion tokens, the events carried {rec.num_tokens}"
    except (OSError, asyncio.IncompleteReadError, ProtocolError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        conn.close()
    rec.done_s = time.perf_counter()
    return rec
