"""py-spy on this process and every Ray actor below it, for the serving benchmark's --profile."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.cpu_account import children_by_pid


def actor_processes() -> list[tuple[int, str]]:
    """(pid, title) of the Ray actor processes below this one (a ``serve run`` child's included)."""
    children = children_by_pid()
    found, todo = [], list(children[os.getpid()])
    while todo:
        pid = todo.pop()
        todo += children[pid]
        with contextlib.suppress(OSError):
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            if title.startswith("ray::") and not title.startswith("ray::IDLE"):
                found.append((pid, re.sub(r"[^A-Za-z0-9_.-]+", "_", title[5:])[:40]))
    return found


class Profiler:
    """``py-spy record --gil`` on this process and every actor process below it, until ``stop``."""

    def __init__(self, out: Path, name: str, rate: int) -> None:
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(spy).exists():
            raise RuntimeError("--profile needs py-spy (pip install py-spy)")
        out.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
        for pid, title in [(os.getpid(), "driver"), *actor_processes()]:
            path = out / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}_{title}_{pid}.txt"
            cmd = f"{spy} record -p {pid} -r {rate} -f raw -o {path} --threads --gil --nonblocking".split()
            log = path.with_suffix(".log").open("wb")
            self.procs[f"{title}:{pid}"] = (subprocess.Popen(cmd, stdout=log, stderr=log), path)

    def stop(self, top: int = 30) -> dict[str, Any]:
        """Per process: GIL samples per thread and the functions holding it longest (inclusive)."""
        out: dict[str, Any] = {}
        for proc, _ in self.procs.values():
            proc.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
        for key, (proc, path) in self.procs.items():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)
            if not path.exists():
                out[key] = {"error": path.with_suffix(".log").read_text(errors="replace")[-300:]}
                continue
            threads: collections.Counter[str] = collections.Counter()
            funcs: collections.Counter[tuple[str, str]] = collections.Counter()
            for line in path.read_text().splitlines():
                stack, _, count = line.rpartition(" ")
                frames = stack.split(";")
                thread, n = frames[0].split(":")[-1].strip(), int(count or 0)
                threads[thread] += n
                for fn in dict.fromkeys(f.split(" (")[0] for f in frames[1:]):
                    if fn not in ("Thread._bootstrap", "Thread._bootstrap_inner", "Thread.run", "<module>"):
                        funcs[(thread, fn)] += n
            out[key] = {"samples": sum(threads.values()), "threads": dict(threads.most_common())}
            out[key]["top"] = [[t, f, n] for (t, f), n in funcs.most_common(top)]
        return out
