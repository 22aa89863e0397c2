"""One ``serve run`` child for a test module: started, waited for, and always cleaned up."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from moriio_ray.serve.process import ServeProcess


@contextlib.contextmanager
def running(config: str | Path, *, start_timeout_s: float = 240.0) -> Iterator[ServeProcess]:
    """``serve run config`` until the block ends: stopped with SIGINT, then whatever is left of it
    killed and its work dir removed, even when a test failed."""
    proc = ServeProcess(config)
    proc.start()
    try:
        proc.wait_healthy(timeout_s=start_timeout_s)
        yield proc
    finally:
        if proc.proc is not None and proc.proc.poll() is None:
            try:
                proc.stop(timeout_s=60)
            except Exception:
                pass
        proc.kill()
        proc.remove_work_dir()


class Shared:
    """One ``serve run`` for every test module that serves the same config (each start costs tens
    of seconds on 2 cores). ``get`` starts it, or starts a new one where a test stopped it (the
    clean-shutdown test does); ``close`` ends whatever runs, at the end of the session."""

    def __init__(self, config: str | Path, *, start_timeout_s: float = 240.0) -> None:
        self.config, self.start_timeout_s = config, start_timeout_s
        self._stack: contextlib.ExitStack | None = None
        self._proc: ServeProcess | None = None

    def get(self) -> ServeProcess:
        if self._proc is None or self._proc.proc is None or self._proc.proc.poll() is not None:
            self.close()
            self._stack = contextlib.ExitStack()
            self._proc = self._stack.enter_context(running(self.config, start_timeout_s=self.start_timeout_s))
        return self._proc

    def close(self) -> None:
        stack, self._stack, self._proc = self._stack, None, None
        if stack is not None:
            stack.close()
