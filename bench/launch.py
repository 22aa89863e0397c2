"""``serve run`` a config in a child process, for the benchmarks and the end-to-end tests.

The child gets its own process group and its own Ray temp dir, so it starts a private local Ray
cluster that nothing else on the machine shares, and everything it spawned can be found (and, on a
failure, ended) by process group or by that dir. ``stop`` sends SIGINT, as Ctrl-C would: ``serve
run`` then shuts Serve down (the ingress stops the pipeline it launched) and its Ray cluster exits.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

import yaml

from moriio_ray.errors import DeadlineExceeded, MoriioRayError
from moriio_ray.serve.serve_mode import isolated

_POLL_S = 0.25


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw.decode(errors="replace")


def _default_sigint() -> None:
    # A parent started in the background (nohup, `cmd &`) ignores SIGINT, and an ignored signal stays
    # ignored across exec: Python in the child would then never raise KeyboardInterrupt on SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port() -> int:
    """A TCP port that was free a moment ago (for the child's HTTP proxy)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_SERVE_CLI = "import sys; from ray.serve.scripts import cli; sys.argv[0] = 'serve'; sys.exit(cli())"


class ServeProcess:
    """One ``serve run`` child on a copy of ``config_path`` listening on ``http_port`` (in the fast
    serve mode HAProxy gets free ports and keeps its files in the work dir: see ``serve_mode``);
    ``env``: variables the child gets on top of this process's environment."""

    def __init__(
        self, config_path: str | Path, *, http_port: int | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.http_port = http_port or free_port()
        self.env = dict(env or {})
        self.work_dir = Path(tempfile.mkdtemp(prefix="mrs"))  # short: Ray's socket paths live below it
        self.ray_tmp = self.work_dir / "ray"
        self.config_path = self.work_dir / "serve.yaml"
        self.log_path = self.work_dir / "serve.log"
        doc = yaml.safe_load(Path(config_path).read_text())
        doc = isolated(doc, free_port, str(self.work_dir / "h"))  # HAProxy's files, removed with it
        doc.setdefault("http_options", {})
        doc["http_options"].update({"host": "127.0.0.1", "port": self.http_port})
        self.config_path.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> None:
        serve_bin = Path(sys.executable).with_name("serve")
        # Ray's `serve` script beside this interpreter, else its entry point run by this interpreter
        # (an environment whose packages sit on PYTHONPATH has no script there)
        serve = [str(serve_bin)] if serve_bin.exists() else [sys.executable, "-c", _SERVE_CLI]
        # `env` adds the variables to the inherited environment without this process reading it.
        cmd = ["env", f"RAY_TMPDIR={self.work_dir}", "RAY_USAGE_STATS_ENABLED=0"]
        cmd += [f"{k}={v}" for k, v in self.env.items()] + serve
        cmd += ["run", str(self.config_path)]
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=Path.cwd(),
            preexec_fn=_default_sigint,
        )

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        """Poll ``GET /health`` until it answers 200; raise with the log's tail if the child dies."""
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            if self.proc is None or self.proc.poll() is not None:
                raise MoriioRayError(f"serve run exited before it was healthy:\n{self.log_tail()}")
            if self.get("/health")[0] == 200:
                return
            time.sleep(_POLL_S)
        raise DeadlineExceeded(f"serve run was not healthy within {timeout_s} s:\n{self.log_tail()}")

    def get(self, path: str, timeout_s: float = 10.0) -> tuple[int, Any]:
        """(status, body parsed as JSON when it is JSON) of a GET; status 0 when nothing answered."""
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=timeout_s) as resp:
                return resp.status, _parse(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _parse(exc.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, None

    def stop(self, timeout_s: float = 90.0) -> int:
        """SIGINT (Ctrl-C) and wait for ``serve run`` to exit; its exit code. Kills it after the timeout."""
        assert self.proc is not None, "not started"
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                raise DeadlineExceeded(
                    f"serve run did not exit within {timeout_s} s of SIGINT:\n{self.log_tail()}"
                ) from None
        if self._log is not None:
            self._log.close()
        return int(self.proc.returncode)

    def leftover_pids(self) -> list[int]:
        """Live processes this child started: in its process group, or run with its Ray temp dir."""
        if self.proc is None:
            return []
        found = []
        marker = str(self.work_dir).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                pgid = os.getpgid(int(entry.name))
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                # Ray's workers rename themselves and may leave the group, but inherit RAY_TMPDIR
                mine = pgid == self.proc.pid or marker in (entry / "cmdline").read_bytes()
                mine = mine or marker in (entry / "environ").read_bytes()
            except (OSError, IndexError):
                continue
            if state != "Z" and mine:
                found.append(int(entry.name))
        return found

    def wait_no_leftovers(self, timeout_s: float = 30.0) -> list[int]:
        """Wait up to ``timeout_s`` for every process of this child to exit; the ones still alive."""
        deadline_s = time.monotonic() + timeout_s
        left = self.leftover_pids()
        while left and time.monotonic() < deadline_s:
            time.sleep(_POLL_S)
            left = self.leftover_pids()
        return left

    def kill(self) -> None:
        """SIGKILL the child's process group and any process still running from its Ray temp dir."""
        for pid in self.leftover_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            try:
                self.proc.wait(10.0)
            except subprocess.TimeoutExpired:
                pass

    def metrics_targets(self) -> list[str]:
        """``host:port`` of every node's Prometheus endpoint, from Ray's service-discovery file."""
        path = self.ray_tmp / "session_latest" / "prom_metrics_service_discovery.json"
        try:
            groups = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return []
        return [target for group in groups for target in group.get("targets", [])]

    def remove_work_dir(self) -> None:
        """Delete the copied config, the log and the Ray session dir (call once everything exited)."""
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return "<no log>"

    def __enter__(self) -> ServeProcess:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.kill()
            self.remove_work_dir()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.stop()
        finally:
            self.kill()
            self.remove_work_dir()
