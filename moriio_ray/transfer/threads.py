"""A small fixed pool of daemon threads, shared by the tcp and shm backends."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

_JOIN_S = 2.0


class ThreadPool:
    """A fixed set of daemon threads that run submitted jobs; ``close`` joins them with a timeout."""

    def __init__(self, num_threads: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True) for i in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(_JOIN_S)
