"""One ``serve run`` child for a test module: started, waited for, and always cleaned up."""

from __future__ import annotations

import contextlib
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.launch import ServeProcess

SERVE_DOC = Path(__file__).resolve().parents[2] / "docs" / "serve.md"


@contextlib.contextmanager
def running(
    config: str | Path, *, start_timeout_s: float = 240.0, env: dict[str, str] | None = None
) -> Iterator[ServeProcess]:
    """``serve run config`` (``env``: on top of this environment) until the block ends: stopped with
    SIGINT, then whatever is left of it killed and its work dir removed, even when a test failed."""
    proc = ServeProcess(config, env=env)
    proc.start()
    try:
        proc.wait_healthy(timeout_s=start_timeout_s)
        yield proc
    finally:
        stop_if_running(proc)
        proc.kill()
        proc.remove_work_dir()


def stop_if_running(proc: ServeProcess) -> None:
    """SIGINT to a ``serve run`` still running, waited for up to 60 s (whatever is left: ``kill``)."""
    if proc.proc is not None and proc.proc.poll() is None:
        try:
            proc.stop(timeout_s=60)
        except Exception:
            pass


def haproxy_pids(server: ServeProcess) -> list[int]:
    """The HAProxy processes of this child's cluster: Serve's fast path (every config in configs/)
    puts one in front of the ingress replicas."""
    found = []
    for pid in server.leftover_pids():
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if Path(argv0.decode(errors="replace")).name == "haproxy":
            found.append(pid)
    return found


def worker_stats(server: ServeProcess) -> dict[str, dict[str, Any]]:
    """Every engine's counters, from the ingress's /stats."""
    status, body = server.get("/stats")
    assert status == 200, body
    workers: dict[str, dict[str, Any]] = body["workers"]
    return workers


def quiet(workers: dict[str, dict[str, Any]], *, leases: bool = False) -> bool:
    """No engine runs or queues a request and all its blocks are free (``leases``: none leased)."""
    return all(
        w["num_free_blocks"] == w["num_blocks"]
        and (not leases or w["num_leased_blocks"] == 0)
        and w["num_running"] == 0
        and w["num_waiting"] == 0
        for w in workers.values()
    )


def wait_quiet(
    server: ServeProcess, timeout_s: float, *, leases: bool = False, poll_s: float = 0.05
) -> tuple[bool, float, dict[str, dict[str, Any]]]:
    """(quiet, seconds it took, the last stats), polling /stats up to ``timeout_s``."""
    t0 = time.monotonic()
    workers = worker_stats(server)
    while not quiet(workers, leases=leases) and time.monotonic() - t0 < timeout_s:
        time.sleep(poll_s)
        workers = worker_stats(server)
    return quiet(workers, leases=leases), time.monotonic() - t0, workers


class Shared:
    """One ``serve run`` for every test module that serves the same config (each start costs tens
    of seconds on 2 cores). ``get`` starts it, or starts a new one where a test stopped it (the
    clean-shutdown test does); ``close`` ends whatever runs, at the end of the session."""

    def __init__(
        self, config: str | Path, *, start_timeout_s: float = 240.0, env: dict[str, str] | None = None
    ) -> None:
        self.config, self.start_timeout_s, self.env = config, start_timeout_s, env
        self._stack: contextlib.ExitStack | None = None
        self._proc: ServeProcess | None = None

    def get(self) -> ServeProcess:
        if self._proc is None or self._proc.proc is None or self._proc.proc.poll() is not None:
            self.close()
            self._stack = contextlib.ExitStack()
            self._proc = self._stack.enter_context(
                running(self.config, start_timeout_s=self.start_timeout_s, env=self.env)
            )
        return self._proc

    def close(self) -> None:
        stack, self._stack, self._proc = self._stack, None, None
        if stack is not None:
            stack.close()


def readme_metrics() -> list[str]:
    """The metric names that docs/serve.md's Metrics section lists (``ray_moriio_...``)."""
    section = SERVE_DOC.read_text().split("\n### Metrics (Prometheus)\n", 1)[1].split("\n### ", 1)[0]
    return sorted(set(re.findall(r"`(ray_moriio_[a-z_]+)`", section)))


def missing_metrics(targets: list[str], names: list[str], timeout_s: float) -> list[str]:
    """Scrape ``host:port/metrics`` of every target until each name has a sample (a histogram's
    ``_bucket``, ``_sum``, ``_count`` count) or ``timeout_s`` passed; the names still missing."""
    deadline_s = time.monotonic() + timeout_s
    missing = list(names)
    while True:
        pages = []
        for target in targets:
            try:
                with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as resp:
                    pages.append(resp.read().decode())
            except OSError:
                continue
        text = "\n".join(pages)
        missing = [n for n in names if not re.search(rf"^{n}(_bucket|_sum|_count)?[{{ ]", text, re.M)]
        if not missing or time.monotonic() > deadline_s:
            return missing
        time.sleep(1.0)  # Ray's metrics agent exports on a period of a few seconds
