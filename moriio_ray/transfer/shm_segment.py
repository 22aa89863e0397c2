"""POSIX shared-memory segments for the shm backend: create, map, liveness, sweep.

A segment is a file in the shared-memory directory named ``moriio-<pid>-<n>-<key>``. Its first
page is a header that the owner keeps up to date and peers check around every copy:

    magic, version, state (1 live, 0 closed), owner pid, epoch, data bytes   (64 bytes)
    region table: up to 126 entries of (mem_id, offset, num_bytes, 0)         (32 bytes each)

The data follows at ``HEADER_BYTES``. The owner clears ``state`` before it unlinks the file, so a
peer that still has it mapped sees the owner leave; a killed owner is seen through its pid.
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
import struct
from pathlib import Path

import numpy as np

from moriio_ray.errors import BackendUnavailable, ConfigError, PeerLost, StaleDescriptor

SHM_DIR = Path("/dev/shm")  # where POSIX shm_open puts segments on Linux
PREFIX = "moriio-"
MAGIC = b"MORIOSHM"
VERSION = 1
HEADER_BYTES = 4096
_HEAD = struct.Struct("<8sIIqqq")  # magic, version, state, pid, epoch, data bytes
_TABLE_AT = 64
MAX_REGIONS = (HEADER_BYTES - _TABLE_AT) // 32
_STATE, _PID, _EPOCH = 3, 2, 3  # state is uint32 word 3; pid and epoch are int64 words 2 and 3
_NAME = re.compile(rf"^{PREFIX}(?P<pid>\d+)-\d+-")
_counter = itertools.count()


def pid_alive(pid: int) -> bool:
    """Whether a process of this host (and pid namespace) runs; a zombie counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs: trust the signal check
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


class Segment:
    """One mapped segment, as owner (``create``) or as peer (``attach``)."""

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name = name
        self._mm = mm  # never closed by hand: tensors and arrays keep the mapping alive
        raw = np.frombuffer(mm, dtype=np.uint8)
        self.words32 = raw[:_TABLE_AT].view(np.uint32)  # [16]
        self.words64 = raw[:_TABLE_AT].view(np.int64)  # [8]
        self.table = raw[_TABLE_AT:HEADER_BYTES].view(np.int64).reshape(MAX_REGIONS, 4)
        self.data = raw[HEADER_BYTES:]  # [data_bytes] uint8

    # -- owner side -----------------------------------------------------------------------------

    @classmethod
    def create(cls, key: str, epoch: int, num_bytes: int) -> Segment:
        safe_key = re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:120]
        name = f"{PREFIX}{os.getpid()}-{next(_counter)}-{safe_key}"
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # reserve the pages now: a sparse file on a full tmpfs would SIGBUS on first touch instead
            os.posix_fallocate(fd, 0, HEADER_BYTES + num_bytes)
            mm = mmap.mmap(fd, HEADER_BYTES + num_bytes)
        except OSError as exc:
            os.unlink(SHM_DIR / name)
            raise BackendUnavailable(
                f"shm: cannot reserve {num_bytes} bytes in {SHM_DIR} ({exc}); free space there, "
                "give the container a larger /dev/shm, or use a smaller KV cache"
            ) from None
        finally:
            os.close(fd)
        seg = cls(name, mm)
        _HEAD.pack_into(mm, 0, MAGIC, VERSION, 1, os.getpid(), epoch, num_bytes)
        return seg

    def add_region(self, mem_id: int, offset: int, num_bytes: int) -> None:
        free = np.flatnonzero(self.table[:, 0] == 0)
        if free.size == 0:
            raise ConfigError(f"register: segment {self.name} holds {MAX_REGIONS} regions already")
        self.table[int(free[0])] = (mem_id, offset, num_bytes, 0)

    def drop_region(self, mem_id: int) -> None:
        self.table[self.table[:, 0] == mem_id] = 0

    def retire(self) -> None:
        """Mark the segment closed for every peer, then unlink its name (the memory lives on while mapped)."""
        self.words32[_STATE] = 0
        try:
            os.unlink(SHM_DIR / self.name)
        except FileNotFoundError:
            pass  # swept already

    # -- peer side ------------------------------------------------------------------------------

    @classmethod
    def attach(cls, name: str, owner_key: str) -> Segment:
        if not name.startswith(PREFIX) or "/" in name:
            raise ConfigError(f"peer {owner_key!r}: {name!r} is not a moriio shm segment name")
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR)
        except FileNotFoundError:
            raise PeerLost(
                f"peer {owner_key!r}: its shared memory {name} is gone (the peer closed)"
            ) from None
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        seg = cls(name, mm)
        if bytes(mm[:8]) != MAGIC or int(seg.words32[2]) != VERSION:
            raise ConfigError(f"peer {owner_key!r}: {name} is not a version-{VERSION} moriio shm segment")
        return seg

    def region_bytes(self, mem_id: int) -> tuple[int, int] | None:
        """(offset, num_bytes) of a registered region, from the owner's table; None if not registered."""
        rows = np.flatnonzero(self.table[:, 0] == mem_id)
        if rows.size == 0:
            return None
        row = self.table[int(rows[0])]
        return int(row[1]), int(row[2])

    def check_live(self, owner_key: str, epoch: int, *, check_pid: bool = True) -> None:
        """Raise unless the owner is live, runs ``epoch`` and (``check_pid``) its process exists."""
        if int(self.words64[_EPOCH]) != epoch:
            raise StaleDescriptor(
                f"peer {owner_key!r}: its shared memory belongs to epoch {int(self.words64[_EPOCH])}, the "
                f"descriptor to epoch {epoch}; fetch fresh descriptors from the coordinator"
            )
        if int(self.words32[_STATE]) != 1:
            raise PeerLost(f"peer {owner_key!r} closed its shared memory {self.name}")
        pid = int(self.words64[_PID])
        if check_pid and not pid_alive(pid):
            raise PeerLost(f"peer {owner_key!r} (pid {pid}) died; its shared memory {self.name} is stale")


def sweep_stale_segments() -> list[str]:
    """Unlink every ``moriio-`` segment of this host whose owner process is dead; returns their names."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        match = _NAME.match(path.name)
        if match is None or pid_alive(int(match.group("pid"))):
            continue
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            continue  # another sweeper was first
    return sorted(removed)
