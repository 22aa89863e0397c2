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
