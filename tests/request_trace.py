"""What one request runs: the project functions every process executes for it, and its Ray calls.

    python -m tests.request_trace --config configs/tiny_1p1d_cpu.yaml --modes read,write,colocated --out DIR

For each mode (a pool of its own: ``transfer.mode`` read or write, or the config's pool turned into
one colocated replica), this starts a private ``serve run`` of a config derived from ``--config``
with a profile hook in every Python process of its Ray cluster, and records four windows:

- ``req1``: one streamed ``/v1/completions`` request of ``--tokens`` tokens, after ``--warmups``
  warm-up requests (each prompt unique, so that no prefix-cache hit changes the path);
- ``idle``: as long as ``req1``, with no request: what runs in the background (the coordinator's
  pings and health checks, membership polls, lease sweeps, watchdogs);
- ``req8``: ``--concurrency`` concurrent requests of ``--conc-tokens`` tokens;
- ``idle8``: as long as ``req8``, with no request.

A function is counted for a request when a process ran it in the request window and that same
process did not run it in the idle window (the subtraction is per process: the coordinator's pings
do not take ``deadline`` off the ingress's count; the JSON also gives the count with one global
idle set). Functions are code objects of the repository's packages (``moriio_ray``, ``serve_apps``):
distinct (file, def line, name), lambdas included, tests and site-packages not; a comprehension or
generator expression is part of the function it is written in (``code_objects`` counts them
apart). The model's forward is left out: nothing that runs under a ``torch.nn.Module`` call is
recorded, except a call from the model out to project code beyond ``moriio_ray/engine`` (the
per-layer hook of a prefill worker, which looks requests up and pushes KV in WRITE) and what that
calls. A counted function is "non-leaf" when it called another project function directly in that
window.

Ray calls are ``ray.actor.ActorMethod._remote`` invocations, from any process, by (caller process,
method, target actor). A request's calls are those to the project's actors; the workers' output
stream (``outputs``, one long streaming call per caller and period) and any call whose (caller,
method, target) also happened in the idle window are reported apart. Output items are the
``OutputBatch`` messages the ingress decoded.

The hook half of this file imports the standard library only: the ``sitecustomize.py`` put on the
``serve run`` child's ``PYTHONPATH`` (which the raylet and every Ray worker inherit) loads it by path
in every Python process and calls ``install``. It sets ``sys.setprofile`` and
``threading.setprofile``; outside a window the profile function returns at once. A thread in each
process polls a control file every ``POLL_S`` and opens or closes a window; on closing one it writes
``<trace dir>/windows/<window>/<pid>.json`` and acknowledges.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

ENV_DIR = "MORIIO_TRACE_DIR"
ENV_ROOT = "MORIIO_TRACE_ROOT"
ENV_HOOK = "MORIIO_TRACE_HOOK"
POLL_S = 0.02
PACKAGES = ("moriio_ray", "serve_apps")
# Ray's system processes run no project code: no hook there (their cost is not worth paying)
SKIP_CMDLINE = ("dashboard", "log_monitor", "runtime_env/agent", "autoscaler", "ray_client_server")

SITECUSTOMIZE = f"""\
import os
if os.environ.get("{ENV_DIR}") and os.environ.get("{ENV_HOOK}"):
    try:
        import importlib.util as _u, sys as _s
        _spec = _u.spec_from_file_location("_moriio_request_trace_hook", os.environ["{ENV_HOOK}"])
        _mod = _u.module_from_spec(_spec)
        _s.modules[_spec.name] = _mod
        _spec.loader.exec_module(_mod)
        _mod.install()
    except Exception as _exc:  # never break a process over a measurement
        print("request_trace hook not installed:", repr(_exc), file=_s.stderr)
"""

# ------------------------------------------------------------------------------------------------
# the hook: runs in every process of the traced cluster

_WINDOW: str | None = None  # the open window's name; None: the profile function returns at once
_ROOTS: tuple[str, ...] = ()
_DIR = Path(".")
_calls: dict[int, int] = {}  # id(code) -> call events in the window
_codes: dict[int, Any] = {}  # id(code) -> code (kept alive, so that the ids stay unique)
_edges: set[tuple[int, int]] = set()  # (id(caller code), id(callee code)), both project code
_skip: dict[int, Any] = {}  # thread id -> the nn.Module call frame under which nothing is recorded
_resume: dict[int, list[tuple[Any, Any]]] = {}  # thread id -> [(module frame, callback frame)] out of it
_ENGINE = ""  # the engine package's directory: the model's code and what it calls
_module_calls: set[int] = set()  # ids of torch.nn.Module.__call__'s code objects (hashing code is slow)
_ray_calls: list[dict[str, Any]] = []
_output_items = 0
_threads: set[str] = set()
_identity: dict[str, Any] | None = None


def _profile(frame: Any, event: str, arg: Any) -> None:
    if _WINDOW is None:
        return
    _record(frame, event, arg)


def _record(frame: Any, event: str, arg: Any) -> None:
    global _output_items
    tid = threading.get_ident()
    if event == "call":
        code = frame.f_code
        skip = _skip.get(tid)
        if skip is not None:
            # inside the model: only a call out of it into project code beyond the engine (the
            # layer hook: a KV push, a request lookup) is recorded, with what it calls, until it returns
            if not code.co_filename.startswith(_ROOTS) or code.co_filename.startswith(_ENGINE):
                return
            _resume.setdefault(tid, []).append((skip, frame))
            del _skip[tid]
        if code.co_filename.startswith(_ROOTS):
            key = id(code)
            n = _calls.get(key)
            if n is None:
                _calls[key] = 1
                _codes[key] = code
                _threads.add(threading.current_thread().name)
            else:
                _calls[key] = n + 1
            back = frame.f_back
            if back is not None and back.f_code.co_filename.startswith(_ROOTS):
                _codes.setdefault(id(back.f_code), back.f_code)
                _edges.add((id(back.f_code), key))
        elif id(code) in _module_calls:
            _skip[tid] = frame
    elif event == "return":
        if _skip.get(tid) is frame:
            del _skip[tid]
        else:
            resumed = _resume.get(tid)
            if resumed and resumed[-1][1] is frame:
                _skip[tid] = resumed.pop()[0]
    elif event == "c_call" and tid not in _skip and getattr(arg, "__name__", None) == "decode":
        target = getattr(getattr(arg, "__self__", None), "type", None)
        if getattr(target, "__name__", None) == "OutputBatch":
            _output_items += 1


def _site() -> str:
    """The innermost project frame of the caller's stack: where a Ray call was made."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(_ROOTS):
            return f"{_rel(code.co_filename)}:{code.co_firstlineno} {code.co_qualname}"
        frame = frame.f_back
    return "<no project frame>"


def _patch_ray() -> bool:
    mod = sys.modules.get("ray.actor")
    cls = getattr(mod, "ActorMethod", None)
    original = getattr(cls, "_remote", None)
    if original is None:
        return False
    if getattr(original, "_request_trace", False):
        return True

    def _remote(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _WINDOW is not None:
            try:
                handle = self._actor
                desc = handle._ray_actor_creation_function_descriptor
                _ray_calls.append(
                    {
                        "method": self._method_name,
                        "target_class": desc.class_name,
                        "target_module": desc.module_name,
                        "target_actor_id": handle._actor_id.hex(),
                        "site": _site(),
                        "thread": threading.current_thread().name,
                    }
                )
            except Exception as exc:
                _ray_calls.append({"method": "?", "error": repr(exc)})
        return original(self, *args, **kwargs)

    _remote._request_trace = True  # type: ignore[attr-defined]
    cls._remote = _remote  # type: ignore[union-attr]
    return True


def _rel(filename: str) -> str:
    for root in _ROOTS:
        if filename.startswith(root):
            return filename[len(root) - len(root.rstrip("/").rsplit("/", 1)[-1]) - 1 :]
    return filename


def _who() -> dict[str, Any]:
    """This process: pid, command line, Ray actor (id, class, name) and, on an engine worker, its role."""
    global _identity
    if _identity is not None and _identity.get("actor_class"):
        return _identity
    info: dict[str, Any] = {"pid": os.getpid()}
    try:
        info["cmdline"] = Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        info["cmdline"] = " ".join(sys.argv)
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            ctx = ray.get_runtime_context()
            actor_id = ctx.get_actor_id()
            if actor_id:
                info["actor_id"] = actor_id
                info["actor_name"] = ctx.get_actor_name()
                info["actor_class"] = ctx.current_actor._ray_actor_creation_function_descriptor.class_name
    except Exception as exc:
        info["actor_error"] = repr(exc)
    worker_mod = sys.modules.get("moriio_ray.worker.actor")
    if worker_mod is not None and info.get("actor_class") == "EngineWorker":
        for obj in gc.get_objects():
            if issubclass(type(obj), worker_mod.EngineWorker):  # not obj.__class__: proxies warn
                info["role"], info["key"] = obj.role.value, obj.core.key
                break
    pkg = sys.modules.get("moriio_ray")
    info["moriio_ray_file"] = getattr(pkg, "__file__", None)
    _identity = info
    return info


def _flush(window: str) -> None:
    global _calls, _codes, _edges, _ray_calls, _output_items, _threads
    calls, codes, edges, ray_calls, items = _calls, _codes, _edges, _ray_calls, _output_items
    threads, _threads = _threads, set()
    _calls, _codes, _edges, _ray_calls, _output_items = {}, {}, set(), [], 0
    _skip.clear()
    _resume.clear()

    def name(key: int) -> list[Any]:
        code = codes[key]
        return [_rel(code.co_filename), code.co_firstlineno, code.co_qualname]

    doc = {
        **_who(),
        "window": window,
        "functions": [[*name(k), n] for k, n in list(calls.items())],
        "edges": [[name(a), name(b)] for a, b in list(edges)],
        "ray_calls": ray_calls,
        "output_items": items,
        "threads": sorted(threads),
    }
    out = _DIR / "windows" / window
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{os.getpid()}.tmp"
    tmp.write_text(json.dumps(doc))
    tmp.replace(out / f"{os.getpid()}.json")


def _open(window: str) -> None:
    global _WINDOW
    torch = sys.modules.get("torch")
    module = getattr(getattr(torch, "nn", None), "Module", None)
    for attr in ("__call__", "_wrapped_call_impl", "_call_impl"):
        code = getattr(getattr(module, attr, None), "__code__", None)
        if code is not None:
            _module_calls.add(id(code))
    _WINDOW = window


def _poll() -> None:
    global _WINDOW
    ctl, ack = _DIR / "ctl", _DIR / "acks" / str(os.getpid())
    seen: tuple[int, int] | None = None
    patched = False
    while True:
        time.sleep(POLL_S)
        if not patched:
            patched = _patch_ray()
        try:
            st = ctl.stat()
        except OSError:
            continue
        if (st.st_ino, st.st_mtime_ns) == seen:
            continue
        seen = (st.st_ino, st.st_mtime_ns)
        try:
            seq, window = ctl.read_text().split()
        except (OSError, ValueError):
            continue
        try:
            if _WINDOW is not None:
                closing, _WINDOW = _WINDOW, None
                _flush(closing)
            if window != "off":
                _open(window)
        except Exception as exc:
            print(f"request_trace: window {window}: {exc!r}", file=sys.stderr)
        ack.write_text(seq)


def _start_poller() -> None:
    threading.Thread(target=_poll, name="request-trace-poll", daemon=True).start()
    # the executable: a process that registered and then exec'd another program stops being waited for
    (_DIR / "procs" / str(os.getpid())).write_text(os.readlink("/proc/self/exe"))


def install() -> None:
    """Install the hook in this process (called by the generated ``sitecustomize``)."""
    global _ROOTS, _DIR, _ENGINE
    try:
        cmdline = Path("/proc/self/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        cmdline = ""
    if any(part in cmdline for part in SKIP_CMDLINE):
        # a fork of a hooked process registered this pid before it exec'd this program: no waiting for it
        Path(os.environ[ENV_DIR], "procs", str(os.getpid())).unlink(missing_ok=True)
        return
    root = os.path.realpath(os.environ[ENV_ROOT])
    _ROOTS = tuple(f"{root}/{pkg}/" for pkg in PACKAGES)
    _ENGINE = f"{root}/moriio_ray/engine/"
    _DIR = Path(os.environ[ENV_DIR])
    for sub in ("procs", "acks", "windows"):
        (_DIR / sub).mkdir(parents=True, exist_ok=True)
    sys.setprofile(_profile)
    threading.setprofile(_profile)
    _start_poller()
    os.register_at_fork(after_in_child=_start_poller)


# ------------------------------------------------------------------------------------------------
# the driver: serve run, windows, requests, counts

ROOT = Path(__file__).resolve().parents[1]
PROJECT_MODULES = PACKAGES
STREAM_METHODS = ("outputs",)  # the workers' output streams: items, reported apart from the calls
WORKER_KINDS = ("prefill", "decode", "colocated")


def derive(doc: dict[str, Any], mode: str) -> dict[str, Any]:
    """A copy of a Serve config whose (first) application's pool runs ``mode``: ``read`` or
    ``write`` (``transfer.mode``) or ``colocated`` (one colocated replica with the prefill role's
    resources, no prefill or decode)."""
    import copy

    out = copy.deepcopy(doc)
    args = out["applications"][0].setdefault("args", {})
    pool = args.setdefault("pool", {})
    if mode in ("read", "write"):
        args.setdefault("transfer", {})["mode"] = mode
    elif mode == "colocated":
        role = dict(pool.get("prefill") or {})
        role["replicas"] = 1
        pool["colocated"] = role
        pool["prefill"] = {"replicas": 0}
        pool["decode"] = {"replicas": 0}
    else:
        raise ValueError(f"mode: {mode!r} is not read, write or colocated")
    return out


class Control:
    """The driver's end of the windows: writes the control file, waits for every hooked process."""

    def __init__(self, trace_dir: Path) -> None:
        self.dir = trace_dir
        self.seq = 0

    def live_pids(self) -> list[int]:
        pids = []
        for entry in (self.dir / "procs").iterdir():
            try:
                state = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0]
                same = os.readlink(f"/proc/{entry.name}/exe") == entry.read_text()
            except (OSError, IndexError):
                continue
            if state != "Z" and same:
                pids.append(int(entry.name))
        return pids

    def set(self, window: str, timeout_s: float = 10.0) -> list[int]:
        """Open ``window`` (``off``: close the open one) in every process; the pids that did not
        acknowledge within ``timeout_s``."""
        self.seq += 1
        tmp = self.dir / ".ctl.tmp"
        tmp.write_text(f"{self.seq} {window}")
        tmp.replace(self.dir / "ctl")
        deadline_s = time.monotonic() + timeout_s
        while True:
            late = [p for p in self.live_pids() if self._acked(p) < self.seq]
            if not late or time.monotonic() > deadline_s:
                return late
            time.sleep(POLL_S)

    def _acked(self, pid: int) -> int:
        try:
            return int((self.dir / "acks" / str(pid)).read_text() or 0)
        except (OSError, ValueError):
            return 0


def _prompt(i: int) -> str:
    import uuid

    # unique from the first byte: the tiny model's byte tokenizer makes 16 bytes a block, and a
    # shared first block would be a prefix-cache hit
    return f"{uuid.uuid4().hex} request {i}: the quick brown fox jumps over the lazy dog"


def stream_completion(client: Any, model: str, i: int, max_tokens: int) -> dict[str, int]:
    """One streamed /v1/completions request (no usage chunk asked for); its SSE data events."""
    body = {
        "model": model,
        "prompt": _prompt(i),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    events = 0
    with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"/v1/completions: {resp.status_code} {resp.read()!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events += 1
    return {"events": events, "completion_tokens": max_tokens}  # ignore_eos: every one of them


def run_mode(
    config: Path,
    mode: str,
    *,
    tokens: int = 8,
    warmups: int = 3,
    concurrency: int = 8,
    conc_tokens: int = 16,
    start_timeout_s: float = 240.0,
    log: Any = print,
    keep: Path | None = None,
) -> dict[str, Any]:
    """Serve ``config`` in ``mode`` under the hook, run the windows; the mode's report
    (``concurrency=0``: without the concurrent windows). ``keep``: a directory to copy what every
    process wrote into (``<keep>/<mode>-windows``)."""
    import shutil
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import yaml

    from bench.launch import ServeProcess
    from moriio_ray.transfer.shm_segment import sweep_stale_segments

    t_start = time.monotonic()
    trace_dir = Path(tempfile.mkdtemp(prefix="mrt"))
    site = trace_dir / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    doc = derive(yaml.safe_load(Path(config).read_text()), mode)
    app_args = doc["applications"][0]["args"]
    model = (app_args.get("model") or {}).get("name") or (app_args.get("model") or {}).get("preset", "tiny")
    derived = trace_dir / f"{mode}.yaml"
    derived.write_text(yaml.safe_dump(doc, sort_keys=False))
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH")) if p),
        ENV_DIR: str(trace_dir),
        ENV_ROOT: str(ROOT),
        ENV_HOOK: str(Path(__file__).resolve()),
    }
    server = ServeProcess(derived, env=env)
    server.start()
    ctl = Control(trace_dir)
    durations: dict[str, float] = {}
    client_side: dict[str, Any] = {}
    late: dict[str, list[int]] = {}
    try:
        server.wait_healthy(timeout_s=start_timeout_s)
        t_healthy = time.monotonic()
        log(f"[{mode}] healthy after {t_healthy - t_start:.1f} s")
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            for i in range(warmups):
                stream_completion(client, model, i, tokens)
            time.sleep(1.0)  # let the warm-ups' tails (releases, stream periods) pass

            def window(name: str, work: Any) -> None:
                late[name] = ctl.set(name)
                t0 = time.monotonic()
                client_side[name] = work()
                late[name] += ctl.set("off")
                durations[name] = time.monotonic() - t0

            def one() -> dict[str, int]:
                out = stream_completion(client, model, 100, tokens)
                time.sleep(0.2)  # the request's tail: stream closes, releases
                return out

            def many() -> list[dict[str, int]]:
                with ThreadPoolExecutor(concurrency) as pool:
                    futs = [
                        pool.submit(stream_completion, client, model, 200 + i, conc_tokens)
                        for i in range(concurrency)
                    ]
                    out = [f.result() for f in futs]
                time.sleep(0.2)
                return out

            window("req1", one)
            window("idle", lambda: time.sleep(durations["req1"]))
            if concurrency:
                window("req8", many)
                window("idle8", lambda: time.sleep(durations["req8"]))
        t_windows = time.monotonic()
    except BaseException:
        log(f"[{mode}] serve run's log:\n{server.log_tail()}")
        shutil.rmtree(trace_dir, ignore_errors=True)
        raise
    finally:
        # killed, not stopped: every window was flushed, and a clean stop (Serve drains its
        # ingress) would take seconds; the engines' shared memory goes with a sweep
        server.kill()
        server.wait_no_leftovers(timeout_s=10)
        server.remove_work_dir()
        sweep_stale_segments()
    report = analyze(trace_dir, mode, concurrency)
    if keep is not None:
        shutil.copytree(trace_dir / "windows", keep / f"{mode}-windows", dirs_exist_ok=True)
    report["config"] = {
        "derived_from": str(config),
        "pool": app_args.get("pool"),
        "transfer": app_args.get("transfer"),
    }
    report["windows_s"] = {k: round(v, 3) for k, v in durations.items()}
    report["client"] = client_side
    report["late_acks"] = {k: v for k, v in late.items() if v}
    report["timing_s"] = {
        "start": round(t_healthy - t_start, 1),
        "warmups_and_windows": round(t_windows - t_healthy, 1),
        "total": round(time.monotonic() - t_start, 1),
    }
    shutil.rmtree(trace_dir, ignore_errors=True)
    return report


def _kind(proc: dict[str, Any]) -> str:
    cls = proc.get("actor_class") or ""
    if proc.get("role"):
        return str(proc["role"])
    if cls == "Coordinator":
        return "coordinator"
    if cls.endswith("OpenAIIngress"):
        return "ingress"
    if "Rank" in cls:
        return "rank"
    if cls:
        return f"other:{cls}"
    return "driver" if "serve" in proc.get("cmdline", "") else "other"


Windows = dict[str, dict[int, dict[str, Any]]]  # window -> pid -> what that process wrote
COMPREHENSIONS = ("<listcomp>", "<genexpr>", "<setcomp>", "<dictcomp>")


def _is_comprehension(name: str) -> bool:
    return name.endswith(COMPREHENSIONS)


def _order(name: str) -> tuple[str, int]:
    where = name.split(" ", 1)[0]
    return where.rsplit(":", 1)[0], int(where.rsplit(":", 1)[1])


def _files(names: Any) -> int:
    return len({n.split(" ", 1)[0].rsplit(":", 1)[0] for n in names})


def _callers(edges: list[list[Any]]) -> set[str]:
    """The functions that called another project function: a comprehension's calls count for the
    function it runs in, and calling one's own comprehension is no call to further code."""
    parent = {_fn(b): _fn(a) for a, b in edges if _is_comprehension(_fn(b))}

    def owner(name: str) -> str:
        seen = set()
        while _is_comprehension(name) and name in parent and name not in seen:
            seen.add(name)
            name = parent[name]
        return name

    return {owner(_fn(a)) for a, b in edges if not _is_comprehension(_fn(b))}


def _items(docs: dict[int, dict[str, Any]], kinds: dict[int, str]) -> int:
    """The output-stream items (``OutputBatch`` messages) the ingress decoded in a window."""
    return sum(doc["output_items"] for pid, doc in docs.items() if kinds[pid] == "ingress")


def _load(trace_dir: Path, window: str) -> dict[int, dict[str, Any]]:
    found = {}
    for path in sorted((trace_dir / "windows" / window).glob("*.json")):
        doc = json.loads(path.read_text())
        found[doc["pid"]] = doc
    return found


def _fn(entry: list[Any]) -> str:
    return f"{entry[0]}:{entry[1]} {entry[2]}"


def _calls_report(
    windows: Windows, window: str, idle: str, kinds: dict[int, str], requests: int
) -> dict[str, Any]:
    """A window's Ray calls: the request's (to the project's actors, not the output stream, not
    seen in the idle window), and apart: stream opens, background calls, Serve's and Ray's own."""
    by_actor = {
        doc["actor_id"]: kinds[pid]
        for win in (window, idle)
        for pid, doc in windows[win].items()
        if doc.get("actor_id")
    }

    def keyed(win: str) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for pid, doc in windows[win].items():
            for call in doc["ray_calls"]:
                target = by_actor.get(call.get("target_actor_id"), call.get("target_class", "?"))
                key = f"{kinds[pid]} -> {target}.{call.get('method')} ({call.get('target_class')})"
                out.append((key, call))
        return out

    background = {k for k, _ in keyed(idle)}
    request: dict[str, int] = {}
    streams: dict[str, int] = {}
    left_out: dict[str, int] = {}
    serve: dict[str, int] = {}
    sites: dict[str, set[str]] = {}
    from_caller = between = 0
    for key, call in keyed(window):
        project = str(call.get("target_module", "")).startswith(PROJECT_MODULES)
        if not project:
            serve[key] = serve.get(key, 0) + 1
        elif call.get("method") in STREAM_METHODS:
            streams[key] = streams.get(key, 0) + 1
        elif key in background or key.startswith("coordinator ") or " -> coordinator." in key:
            # the coordinator takes no part in a request: calls from it (pings, membership pushes)
            # and to it (the workers' liveness checks) are background even when the short idle
            # window happened to miss them
            left_out[key] = left_out.get(key, 0) + 1
        else:
            request[key] = request.get(key, 0) + 1
            sites.setdefault(key, set()).add(call.get("site", "?"))
            if key.startswith("ingress "):
                from_caller += 1
            else:
                between += 1
    total = sum(request.values())
    return {
        "total": total,
        "per_request": round(total / requests, 3),
        "from_caller": from_caller,
        "between_workers": between,
        "by_method": dict(sorted(request.items())),
        "sites": {k: sorted(v) for k, v in sorted(sites.items())},
        "output_stream_opens": dict(sorted(streams.items())),
        "left_out_as_background": dict(sorted(left_out.items())),
        "serve_and_ray_internal": dict(sorted(serve.items())),
    }


def analyze(trace_dir: Path, mode: str, concurrency: int) -> dict[str, Any]:
    """The mode's report from the windows the processes wrote."""
    windows = {w: _load(trace_dir, w) for w in ("req1", "idle", "req8", "idle8")}
    procs: dict[int, dict[str, Any]] = {}
    for docs in windows.values():
        for pid, doc in docs.items():
            if pid not in procs or doc.get("actor_class"):
                procs[pid] = doc
    kinds = {pid: _kind(doc) for pid, doc in procs.items()}
    warnings = []
    for pid, doc in procs.items():
        src = doc.get("moriio_ray_file")
        if src and not str(src).startswith(str(ROOT)):
            warnings.append(f"pid {pid} ({kinds[pid]}) imports moriio_ray from {src}, not this tree")

    per_process = []
    counted: set[str] = set()  # functions: comprehensions folded into the function they run in
    counted_nonleaf: set[str] = set()
    code_objects: set[str] = set()  # every code object, comprehensions included
    idle_all: set[str] = set()
    for pid, doc in sorted(windows["req1"].items(), key=lambda kv: kinds[kv[0]]):
        idle = {_fn(f) for f in windows["idle"].get(pid, {"functions": []})["functions"]}
        ran = {_fn(f) for f in doc["functions"]}
        idle_all |= idle
        objects = ran - idle
        mine = sorted((f for f in objects if not _is_comprehension(f)), key=_order)
        callers = _callers(doc["edges"])
        nonleaf = [f for f in mine if f in callers]
        code_objects |= objects
        counted |= set(mine)
        counted_nonleaf |= set(nonleaf)
        if not ran and not idle:
            continue
        per_process.append(
            {
                "pid": pid,
                "kind": kinds[pid],
                "actor_class": doc.get("actor_class"),
                "key": doc.get("key"),
                "functions": len(mine),
                "files": _files(mine),
                "non_leaf": len(nonleaf),
                "code_objects": len(objects),
                "ran_in_window": len(ran),
                "ran_when_idle": len(idle),
                "threads": doc.get("threads"),
                "list": [f"{f}{' *' if f in callers else ''}" for f in mine],
            }
        )
    for doc in windows["idle"].values():
        idle_all |= {_fn(f) for f in doc["functions"]}
    req_all = {_fn(f) for doc in windows["req1"].values() for f in doc["functions"]}
    global_set = {f for f in req_all - idle_all if not _is_comprehension(f)}

    one = {
        "functions": len(counted),
        "files": _files(counted),
        "non_leaf": len(counted_nonleaf),
        "non_leaf_files": _files(counted_nonleaf),
        "lambdas": sum(1 for f in counted if f.endswith("<lambda>")),
        "code_objects": len(code_objects),
        "code_objects_files": _files(code_objects),
        "per_kind": {p["kind"]: p["functions"] for p in per_process},
        "per_kind_files": {p["kind"]: p["files"] for p in per_process},
        "per_kind_non_leaf": {p["kind"]: p["non_leaf"] for p in per_process},
        "ray_calls": _calls_report(windows, "req1", "idle", kinds, 1),
        "output_items": _items(windows["req1"], kinds),
        "global_idle_subtraction": {"functions": len(global_set), "files": _files(global_set)},
        "idle_functions": len(idle_all),
        "idle_list": sorted(idle_all, key=_order),
    }
    conc: dict[str, Any] = {}
    if concurrency:
        conc = {
            "requests": concurrency,
            "ray_calls": _calls_report(windows, "req8", "idle8", kinds, concurrency),
            "output_items": _items(windows["req8"], kinds),
        }
    return {
        "mode": mode,
        "processes": {
            str(p): {"kind": kinds[p], "cmdline": procs[p].get("cmdline", "")[:120]} for p in procs
        },
        "one_request": one,
        "per_process": per_process,
        "concurrent": conc,
        "warnings": warnings,
    }


def summary_row(report: dict[str, Any]) -> str:
    one, conc = report["one_request"], report["concurrent"]
    kinds = one["per_kind"]
    calls, ccalls = one["ray_calls"], conc["ray_calls"]
    if not conc:
        return (
            f"{report['mode']:9} functions {one['functions']} ({one['files']} files), non-leaf "
            f"{one['non_leaf']} ({one['non_leaf_files']}); per process {kinds}; Ray calls {calls['total']} "
            f"(caller {calls['from_caller']}, between workers {calls['between_workers']}); "
            f"items 1x: {one['output_items']}"
        )
    streamed8 = sum(max(c["completion_tokens"] - 1, 0) for c in report["client"]["req8"])
    return (
        f"{report['mode']:9} functions {one['functions']} ({one['files']} files), non-leaf {one['non_leaf']} "
        f"({one['non_leaf_files']}); per process {kinds}; Ray calls {calls['total']} "
        f"(caller {calls['from_caller']}, between workers {calls['between_workers']}); "
        f"items 1x: {one['output_items']}, 8x: {conc['output_items']} "
        f"({conc['output_items'] / max(streamed8, 1):.2f}/token), 8x calls/request {ccalls['per_request']}"
    )


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "tiny_1p1d_cpu.yaml"))
    parser.add_argument("--modes", default="read,write,colocated")
    parser.add_argument("--out", required=True, help="directory for request_trace.json")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--warmups", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--conc-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = {}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        reports[mode] = run_mode(
            Path(args.config),
            mode,
            tokens=args.tokens,
            warmups=args.warmups,
            concurrency=args.concurrency,
            conc_tokens=args.conc_tokens,
            keep=out,
        )
        print(summary_row(reports[mode]), flush=True)
        for warning in reports[mode]["warnings"]:
            print("  warning:", warning, flush=True)
        (out / "request_trace.json").write_text(json.dumps(reports, indent=1))
    print(f"written: {out / 'request_trace.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
