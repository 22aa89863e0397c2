"""CPU seconds of every process a serving series runs, by part, read from /proc (Linux).

A part is what the process does for the pipeline: ``caller`` (this driver, through the Python API),
``ingress`` (the Serve replicas that serve HTTP), ``haproxy``, ``worker:<role>`` (each engine's actor,
by the pid its stats report), ``coordinator``, ``serve`` (Serve's controller and proxy), ``client``
(the load generator's processes) and ``ray`` (Ray's own daemons and idle workers). ``take`` reads
every process below this one; the difference of two takes is what each part spent in between. A
process that ended in between is missing from the second take: the load generator's processes
report their own CPU time instead.
"""

from __future__ import annotations

import collections
import contextlib
import os
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
Snapshot = dict[int, tuple[str, float]]  # pid -> (part, CPU seconds so far)


def children_by_pid() -> dict[int, list[int]]:
    """Every process's children (pid -> pids), from /proc."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children[parent].append(int(entry.name))
    return children


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime (fields 14 and 15)


def _part(pid: int, me: int, workers: dict[int, str]) -> str:
    if pid == me:
        return "caller"
    if pid in workers:
        return f"worker:{workers[pid]}"
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    title = argv[0].decode(errors="replace")
    if Path(title).name == "haproxy":
        return "haproxy"
    if title.startswith("ray::Coordinator"):
        return "coordinator"
    if title.startswith("ray::ServeReplica") and "OpenAIIngress" in title:
        return "ingress"
    if title.startswith(("ray::ServeController", "ray::ProxyActor", "ray::ServeReplica")):
        return "serve"
    if b"bench.http_client" in argv[1:3]:
        return "client"
    return "ray"


def take(workers: dict[int, str] | None = None) -> Snapshot:
    """Every process below this one (and this one), with its part and CPU seconds so far.
    ``workers``: the engine actors' pids and roles (from the pipeline's stats)."""
    me, children = os.getpid(), children_by_pid()
    found: Snapshot = {}
    todo = [me]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        with contextlib.suppress(OSError, ValueError, IndexError):
            found[pid] = (_part(pid, me, workers or {}), _cpu_s(pid))
    return found


def spent(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """CPU seconds per part between two takes (processes present in both, or born in between)."""
    out: dict[str, float] = collections.defaultdict(float)
    for pid, (part, cpu_s) in after.items():
        start = before.get(pid, (part, 0.0))[1]
        out[part] += max(0.0, cpu_s - start)
    return dict(sorted(out.items()))


def worker_pids(stats: dict[str, object]) -> dict[int, str]:
    """pid -> role of each engine in a pipeline's stats (``PDPipeline.stats()`` or ``/stats``)."""
    workers = stats.get("workers", {})
    assert isinstance(workers, dict)
    return {w["pid"]: w["role"] for w in workers.values() if isinstance(w, dict) and "pid" in w}
