"""Registered memory as the tcp backend moves it over a socket.

CPU memory goes straight between the socket and the tensor's bytes. GPU memory is staged through
pinned host buffers of ``staging_bytes``: a window of segments is gathered into the buffer and sent,
or received into it and scattered back, one window at a time.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import numpy as np
import torch

from moriio_ray.transfer.tcp_wire import Tick, recv_segments, send_segments


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (no copy)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


class HostRegion:
    """CPU memory: the socket reads into and writes from the tensor's own bytes."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor  # keeps the memory alive while a request uses it
        self.num_bytes = tensor.numel() * tensor.element_size()
        self.view = byte_view(tensor).numpy().data

    def send(self, sock: socket.socket, offsets: np.ndarray, sizes: np.ndarray, tick: Tick | None) -> None:
        send_segments(sock, self.view, offsets, sizes, tick)

    def recv(self, sock: socket.socket, offsets: np.ndarray, sizes: np.ndarray, tick: Tick | None) -> None:
        recv_segments(sock, self.view, offsets, sizes, tick)


def windows(
    offsets: np.ndarray, sizes: np.ndarray, window_bytes: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Split a segment list into windows of at most ``window_bytes``; a segment may span windows.

    Yields (region offsets, piece sizes) per window; the pieces lie back to back in the staging buffer.
    """
    offs: list[int] = []
    lens: list[int] = []
    room = window_bytes
    for off, size in zip(offsets.tolist(), sizes.tolist(), strict=True):
        while size:
            take = min(size, room)
            offs.append(off)
            lens.append(take)
            off, size, room = off + take, size - take, room - take
            if room == 0:
                yield np.asarray(offs, dtype=np.int64), np.asarray(lens, dtype=np.int64)
                offs, lens, room = [], [], window_bytes
    if offs:
        yield np.asarray(offs, dtype=np.int64), np.asarray(lens, dtype=np.int64)


class StagedRegion:
    """GPU memory (or, in tests, CPU memory forced through the same path) staged via host buffers."""

    def __init__(self, tensor: torch.Tensor, staging_bytes: int) -> None:
        self.tensor = tensor
        self.flat = byte_view(tensor)  # [num_bytes] uint8 on the tensor's device
        self.num_bytes = int(self.flat.numel())
        self.staging_bytes = staging_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def _take(self) -> torch.Tensor:
        with self._lock:
            if self._free:
                return self._free.pop()
        pin = torch.cuda.is_available()
        return torch.empty(self.staging_bytes, dtype=torch.uint8, pin_memory=pin)

    def _give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)

    def send(self, sock: socket.socket, offsets: np.ndarray, sizes: np.ndarray, tick: Tick | None) -> None:
        self._staged(sock, offsets, sizes, tick, sending=True)

    def recv(self, sock: socket.socket, offsets: np.ndarray, sizes: np.ndarray, tick: Tick | None) -> None:
        self._staged(sock, offsets, sizes, tick, sending=False)

    def _staged(
        self, sock: socket.socket, offsets: np.ndarray, sizes: np.ndarray, tick: Tick | None, sending: bool
    ) -> None:
        """Window by window: gather then send, or receive then scatter."""
        buf = self._take()
        try:
            view = buf.numpy().data
            moved = 0
            for offs, lens in windows(offsets, sizes, self._window(sizes)):
                if sending:
                    used = self._gather(buf, offs, lens)
                    send_segments(sock, view, *_pieces(used), _shifted(tick, moved))
                else:
                    used = int(lens.sum())
                    recv_segments(sock, view, *_pieces(used), _shifted(tick, moved))
                    self._scatter(buf, offs, lens)
                moved += used
        finally:
            self._give(buf)

    def _window(self, sizes: np.ndarray) -> int:
        """The staging window; a whole number of segments when they all have one size."""
        seg = int(sizes[0]) if sizes.size else 0
        if 0 < seg <= self.staging_bytes and bool((sizes == seg).all()):
            return self.staging_bytes - self.staging_bytes % seg
        return self.staging_bytes

    def _rows(self, offs: np.ndarray, lens: np.ndarray) -> tuple[int, torch.Tensor] | None:
        """(row size, row ids on the device) when the pieces are equal, aligned rows; else None."""
        size = int(lens[0])
        if lens.size < 2 or self.num_bytes % size or bool((lens != size).any()) or bool((offs % size).any()):
            return None
        return size, torch.from_numpy(offs // size).to(self.flat.device)

    def _gather(self, buf: torch.Tensor, offs: np.ndarray, lens: np.ndarray) -> int:
        """Copy the window's pieces from the device into ``buf`` back to back; returns the bytes used."""
        rows = self._rows(offs, lens)
        if rows is not None:
            # one gather on the device, then one copy to the host: no copy call per segment
            size, ids = rows
            picked = self.flat.view(-1, size).index_select(0, ids)  # [k, size]
            buf[: picked.numel()].view(-1, size).copy_(picked)
            self._sync()
            return int(picked.numel())
        pos = 0
        for off, n in zip(offs.tolist(), lens.tolist(), strict=True):
            buf[pos : pos + n].copy_(self.flat[off : off + n], non_blocking=True)
            pos += n
        self._sync()
        return pos

    def _scatter(self, buf: torch.Tensor, offs: np.ndarray, lens: np.ndarray) -> None:
        """Copy the window's pieces from ``buf`` back into the device memory."""
        rows = self._rows(offs, lens)
        if rows is not None:
            size, ids = rows
            staged = buf[: ids.numel() * size].view(-1, size).to(self.flat.device)  # [k, size]
            self.flat.view(-1, size).index_copy_(0, ids, staged)
        else:
            pos = 0
            for off, n in zip(offs.tolist(), lens.tolist(), strict=True):
                self.flat[off : off + n].copy_(buf[pos : pos + n], non_blocking=True)
                pos += n
        # the buffer is refilled for the next window only after these copies have landed
        self._sync()

    def _sync(self) -> None:
        if self.flat.is_cuda:
            torch.cuda.current_stream(self.flat.device).synchronize()


def _pieces(num_bytes: int, piece_bytes: int = 1 << 20) -> tuple[np.ndarray, np.ndarray]:
    """[0, num_bytes) of the staging buffer as 1 MiB segments, so that ticks come during a window."""
    offsets = np.arange(0, num_bytes, piece_bytes, dtype=np.int64)
    return offsets, np.minimum(piece_bytes, num_bytes - offsets)


def _shifted(tick: Tick | None, done_bytes: int) -> Tick | None:
    """A tick that counts the bytes of earlier windows too."""
    if tick is None:
        return None
    return lambda moved: tick(done_bytes + moved)


Region = HostRegion | StagedRegion


def make_region(tensor: torch.Tensor, staging_bytes: int, *, force_staging: bool = False) -> Region:
    """The region wrapper for a registered tensor: staged when it is not in host memory."""
    if tensor.device.type == "cpu" and not force_staging:
        return HostRegion(tensor)
    return StagedRegion(tensor, staging_bytes)
