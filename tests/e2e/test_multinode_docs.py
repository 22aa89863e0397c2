"""The multi-node steps of docs/serve.md, run as printed: two ``ray start`` nodes on one host.

Each node gets its own home directory, as separate hosts would, so the joining node has the
head's token only through ``RAY_AUTH_TOKEN``, the way the docs say. The steps run with these
substitutions: 127.0.0.1 and free ports for ``<head-ip>``, 6379 and 8080; one CPU per node; and a
CPU copy of ``configs/multinode_tcp.yaml`` (tiny preset, ``engine.device: cpu``, one CPU per
engine, so the two engines land on different nodes). Every process carries this test's Ray temp
dir in its environment, so the fixture ends exactly those processes (never a machine-wide
``ray stop``).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from bench.launch import ServeProcess, free_port
from moriio_ray.serve.serve_mode import isolated, mode_of
from tests.e2e.serving import haproxy_pids, stop_if_running

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
SERVE = str(Path(sys.executable).with_name("serve"))


def _documented_steps() -> str:
    text = (ROOT / "docs" / "serve.md").read_text()
    section = text.split("### Multi-node", 1)[1].split("\n### ", 1)[0]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    assert match, "docs/serve.md's Multi-node section has a bash block"
    return match.group(1)


def _cpu_config(work: Path) -> Path:
    doc = yaml.safe_load((ROOT / "configs" / "multinode_tcp.yaml").read_text())
    args = doc["applications"][0]["args"]
    args["model"] = {"preset": "tiny", "max_model_len": 512}
    args["engine"] = {"device": "cpu", "num_blocks": 64}
    for role in ("prefill", "decode"):
        args["pool"][role] = {"replicas": 1, "num_gpus": 0, "num_cpus": 1}
    args["runtime"] = {"worker_start_timeout_s": 180.0}
    path = work / "multinode_cpu.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class TwoNodes:
    """The documented commands, each in an environment of its own node (home dir, auth variables)."""

    def __init__(self, serve: ServeProcess) -> None:
        self.serve = serve
        self.work = serve.work_dir
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.homes = {"head": self.work / "head", "worker": self.work / "worker"}
        for home in self.homes.values():
            home.mkdir()

    def env(self, node: str, **extra: str) -> list[str]:
        # `env` sets these on top of the inherited environment; RAY_TMPDIR also marks every process
        base = {"HOME": str(self.homes[node]), "RAY_TMPDIR": str(self.work), "RAY_USAGE_STATS_ENABLED": "0"}
        return ["env", *(f"{k}={v}" for k, v in {**base, **extra}.items())]

    def run(
        self, node: str, *cmd: str, timeout_s: float = 120.0, **extra: str
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*self.env(node, **extra), *cmd], capture_output=True, text=True, timeout=timeout_s
        )


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[TwoNodes, str]]:
    steps = _documented_steps()
    serve = ServeProcess(ROOT / "configs" / "multinode_tcp.yaml")  # its work dir, config copy and cleanup
    nodes = TwoNodes(serve)
    try:
        yield nodes, steps
    finally:
        stop_if_running(serve)
        if serve.proc is None:  # serve run never started; leftover_pids needs a child to compare with
            serve.proc = subprocess.Popen(["true"])
            serve.proc.wait()
        serve.kill()  # every process run with this test's RAY_TMPDIR: both nodes' raylets, GCS, workers
        serve.remove_work_dir()


@pytest.mark.timeout(420)
def test_documented_multinode_steps(cluster: tuple[TwoNodes, str]) -> None:
    nodes, steps = cluster
    for line in [
        "export RAY_AUTH_MODE=token",
        "ray get-auth-token --generate",
        "ray start --head --port=6379 --metrics-export-port=8080",
        "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=<the head's token>",
        "ray start --address=<head-ip>:6379 --metrics-export-port=8080",
        "RAY_USAGE_STATS_ENABLED=0 serve run --address <head-ip>:6379 configs/multinode_tcp.yaml",
    ]:
        assert line in steps, f"docs/serve.md no longer says {line!r}; update this test with it"
    auth = {"RAY_AUTH_MODE": "token"}
    node_args = ["--num-cpus=1", "--disable-usage-stats"]

    # 1. on the head: a token, then the head node
    gen = nodes.run("head", RAY, "get-auth-token", "--generate", **auth)
    assert gen.returncode == 0, gen.stderr
    token = gen.stdout.strip()
    assert token and (nodes.homes["head"] / ".ray" / "auth_token").read_text().strip() == token
    head = nodes.run(
        "head", RAY, "start", "--head", f"--port={nodes.port}", f"--metrics-export-port={free_port()}",
        "--include-dashboard=false", *node_args, **auth,
    )  # fmt: skip
    assert head.returncode == 0, head.stdout + head.stderr

    # 2. on the other node, with the head's token in RAY_AUTH_TOKEN (its own home has none)
    worker = nodes.run(
        "worker", RAY, "start", f"--address={nodes.address}", f"--metrics-export-port={free_port()}",
        *node_args, RAY_AUTH_TOKEN=token, **auth,
    )  # fmt: skip
    assert worker.returncode == 0, worker.stdout + worker.stderr
    # the joined node shows in `ray status` once the autoscaler's view catches up (poll, bounded)
    deadline_s = time.monotonic() + 60
    while True:
        status = nodes.run(
            "worker", RAY, "status", f"--address={nodes.address}", RAY_AUTH_TOKEN=token, **auth
        )
        if status.returncode == 0 and status.stdout.count(" node_") == 2:
            break
        assert time.monotonic() < deadline_s, status.stdout + status.stderr
        time.sleep(0.25)

    # 3. serve run --address on the head, in the head's environment
    config = _cpu_config(nodes.work)
    nodes.serve.config_path.write_text(config.read_text())
    doc = yaml.safe_load(nodes.serve.config_path.read_text())
    assert mode_of(doc) == "fast"  # the documented config runs Serve's fast path
    # free HAProxy ports and a private HAProxy dir, beside any other HAProxy on this host
    doc = isolated(doc, free_port, str(nodes.serve.work_dir / "h"))
    doc["http_options"] = {"host": "127.0.0.1", "port": nodes.serve.http_port}
    nodes.serve.config_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    log = nodes.serve.log_path.open("wb")
    nodes.serve.proc = subprocess.Popen(
        [*nodes.env("head", **auth), SERVE, "run", "--address", nodes.address, str(nodes.serve.config_path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=ROOT,
        # Ctrl-C must reach it: a test run started in the background (`cmd &`, nohup) ignores
        # SIGINT, and an ignored signal stays ignored across exec
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    nodes.serve._log = log
    nodes.serve.wait_healthy(timeout_s=300)
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(
        nodes.serve.base_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        answer = json.loads(resp.read())
    assert answer["usage"]["completion_tokens"] == 8, answer
    assert haproxy_pids(nodes.serve), "HAProxy should front the API in the fast path"
    # each node has one CPU and each engine takes one, so P and D run on different nodes; a third
    # client (a driver, in the head's environment) sees both nodes' CPUs taken
    probe = (
        "import ray, json; ray.init(address='" + nodes.address + "', logging_level='ERROR');"
        "print(json.dumps([len(ray.nodes()), ray.cluster_resources().get('CPU'), "
        "ray.available_resources().get('CPU', 0.0)]))"
    )
    driver = nodes.run("head", sys.executable, "-c", probe, **auth)
    assert driver.returncode == 0, driver.stderr
    assert json.loads(driver.stdout.strip().splitlines()[-1]) == [2, 2.0, 0.0]
    assert nodes.serve.stop(timeout_s=90) == 0
