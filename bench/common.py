"""What every benchmark shares: one percentile, the run record, the pipeline config of a system, the
one call into a transfer agent, and the plot set-up. No torch or Ray at import time."""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
GOALS = ROOT / "bench" / "goals.json"


def csv(kind: type) -> Any:
    """An argparse type: a comma-separated list of ``kind``."""
    return lambda text: [kind(x) for x in text.split(",") if x]


def load_goals(kind: str) -> Any:
    """The goals of one benchmark, from bench/goals.json."""
    return json.loads(GOALS.read_text())[kind]


# -- statistics ------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0 <= q <= 1), linear between order statistics; None if empty. Every table of
    every benchmark uses this one."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q: {q!r} must be in [0, 1]")
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def median(values: list[float]) -> float:
    """The p50 of ``values`` (0.0 when empty)."""
    return percentile(values, 0.5) or 0.0


def stats(values: list[float]) -> dict[str, float | None]:
    """p50, p99 and mean of ``values`` (None each when empty)."""
    mean = statistics.fmean(values) if values else None
    return {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99), "mean": mean}


def describe(exc: BaseException) -> str:
    """An exception as one line for a report."""
    return f"{type(exc).__name__}: {exc}".replace("\n", " | ")[:500]


# -- the run record --------------------------------------------------------------------------------


def repo_path(path: str | Path) -> str:
    """A file as a record names it: its path in the repository, or its name alone (no machine paths)."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else resolved.name


def git_commit() -> str:
    try:
        cmd = ["git", "describe", "--always", "--dirty"]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return out or "unknown"


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def command_line(argv: list[str] | None = None) -> str:
    """``argv`` (default: this process's, interpreter first) as a user types it in the repository's
    root: ``python``, then ``-m bench.x`` or the script, shell-quoted, every path repo-relative."""
    words = argv if argv is not None else getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    return shlex.join(["python", *(_shown_word(w) for w in words[1:])])


def _shown_word(word: str) -> str:
    """A word of a command line with the path in it, if any, as a record names it (``--out=/x`` and
    ``model.path=/x`` too)."""
    if _is_path(word):
        return repo_path(Path(word).expanduser())
    key, eq, value = word.partition("=")
    return key + eq + _shown_word(value) if eq and re.fullmatch(r"[\w.\-]+", key) else word


def _is_path(word: str) -> bool:
    """Absolute, from home, or an existing file named with a folder or an extension."""
    if word.startswith(("/", "~")):
        return True
    return ("/" in word or "." in word) and os.path.exists(word)


def machine_line(cpu: str, cpu_count: int | None, gpus: list[str]) -> str:
    """The host in one line: its GPUs by name and count, then its cores and CPU model."""
    if not gpus:
        return f"{cpu_count} cores ({cpu}), no GPU"
    counts = {name: gpus.count(name) for name in dict.fromkeys(gpus)}
    shown = ", ".join(f"{'one' if n == 1 else n} {name}" for name, n in counts.items())
    return f"{shown}, {cpu_count} host cores ({cpu})"


def run_record(benchmark: str, args: dict[str, Any], commit: str | None = None) -> dict[str, Any]:
    """The head of every result file: first ``record`` (the commit, the machine in one line and the
    command that ran), then what ran, on what host, with which arguments (paths repo-relative)."""
    host: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    gpus: list[str] = []
    try:
        import torch

        host["torch"] = torch.__version__
        if torch.cuda.is_available():
            host["gpu"] = torch.cuda.get_device_name()
            gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    host["load_avg_1m_before"] = os.getloadavg()[0]
    shown = {k: repo_path(v) if isinstance(v, Path) else v for k, v in args.items() if k != "out"}
    commit = commit or git_commit()
    record = {
        "commit": commit,
        "machine": machine_line(host["cpu"], host["cpu_count"], gpus),
        "command": command_line(),
    }
    return {"record": record, "benchmark": benchmark, "commit": commit, "host": host, "args": shown}


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if "host" in doc:
        doc["host"]["load_avg_1m_after"] = os.getloadavg()[0]
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")


# -- configs ---------------------------------------------------------------------------------------


def serve_doc(path: Path) -> dict[str, Any]:
    """A Serve config file (a bare pipeline config is wrapped as the args of one application)."""
    doc = yaml.safe_load(Path(path).read_text()) or {}
    if "applications" not in doc:
        doc = {
            "applications": [{"import_path": "serve_apps.pd_openai:app", "route_prefix": "/", "args": doc}]
        }
    return dict(doc)


def set_path(args: dict[str, Any], assignment: str) -> None:
    """``a.b.c=value`` (the value read as YAML) into ``args``."""
    key, _, text = assignment.partition("=")
    *parents, leaf = key.strip().split(".")
    node = args
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = yaml.safe_load(text)


def pipeline_args(
    base: dict[str, Any],
    system: str,
    *,
    backend: str | None = None,
    gpu: bool = False,
    max_concurrency: int = 64,
    max_prompt_len: int = 1024,
    output_tokens: int = 64,
    colocated_replicas: int = 1,
    overrides: tuple[str, ...] | list[str] = (),
) -> dict[str, Any]:
    """The pipeline config (a Serve app's ``args``) of ``system`` (colocated, read, write) from
    ``base``: room for ``max_concurrency`` requests of the longest prompt in every engine (a fixed
    ``num_blocks``, so that engines sharing a GPU fit whatever starts first), then ``overrides``."""
    if system not in ("colocated", "read", "write"):
        raise ValueError(f"system: {system!r} is not one of colocated, read, write")
    args = copy.deepcopy(base)
    engine = args.setdefault("engine", {})
    block = int(engine.get("block_size", 16))
    max_len = max_prompt_len + output_tokens + block
    args["name"] = f"bench-{system}"
    args.setdefault("model", {})["max_model_len"] = max_len
    engine.update(
        device="cuda" if gpu else "cpu",
        num_blocks=max_concurrency * -(-max_len // block) + 16,
        max_num_seqs=max_concurrency,
        max_num_batched_tokens=max(int(engine.get("max_num_batched_tokens", 4096)), max_prompt_len),
    )
    transfer = args.setdefault("transfer", {})
    transfer["backend"] = backend or ("cuda_ipc" if gpu else "shm")
    transfer["mode"] = "write" if system == "write" else "read"
    role = {"replicas": 1, "num_gpus": 0.5 if gpu else 0.0, "num_cpus": 1.0 if gpu else 0.5}
    if system == "colocated":
        one = {**role, "replicas": colocated_replicas, "num_gpus": 1.0 if gpu else 0.0}
        pool: dict[str, Any] = {"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "colocated": one}
    else:
        pool = {"prefill": dict(role), "decode": dict(role)}
    pool["placement_strategy"] = "STRICT_PACK" if gpu else "PACK"
    args["pool"] = pool
    serve = args.setdefault("serve", {})
    serve["max_ongoing_requests"] = 2 * max_concurrency  # no 429 from the benchmark's own load
    for assignment in overrides:
        set_path(args, assignment)
    from moriio_ray import parse_pipeline_config

    parse_pipeline_config(args)  # fail before anything starts
    return args


# -- the transfer agents ---------------------------------------------------------------------------


def agent_op(
    agent: Any, op: str, local: Any, remote: Any, local_off: Any, remote_off: Any, sizes: Any
) -> Any:
    """The benches' one call into a transfer agent: ``op`` (read, write) of segments, a handle."""
    from moriio_ray.transfer.plan import TransferPlan

    call = agent.read if op == "read" else agent.write
    return call(local, remote, TransferPlan(local_off, remote_off, sizes))


# -- plots -----------------------------------------------------------------------------------------


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path, title: str = "") -> None:
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
