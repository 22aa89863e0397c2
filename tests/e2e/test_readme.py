"""Every code block of README.md and docs/*.md is run (or named here, with the test that covers it)
and, where the page shows an answer, gives that answer.

A block directly followed by a ``text`` block prints that text; in it ``…`` stands for any run of
characters (ids, timestamps). Blocks that talk to ``localhost:8000`` run against ``serve run``: on
the config that ``make serve`` serves (the Makefile's ``CONFIG``), started once for the module, or,
for blocks that name the ``tiny`` model, on ``configs/tiny_1p1d_cpu.yaml`` (the session's shared
server). Other ``python`` blocks run as scripts, each with its own local Ray where it starts one.
Benchmark commands are parsed with their script's own parser (``tests/unit/test_docs.py``), not run:
they take minutes. The rest are in ``NOT_RUN`` with the reason; a block in no category fails the
test, so a new example must be wired in.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.launch import ServeProcess
from tests.docs_blocks import ROOT, Block, doc_blocks, is_bench_commands
from tests.e2e.serving import Shared, running

# (page, first line of a block) -> why this test does not run it
NOT_RUN = {
    ("README.md", "make serve"): "make test runs this test; make serve is `serve run $(CONFIG)`, which the "
    "fixture runs",
    ("README.md", "python -m venv .venv"): "the Makefile's install target runs these steps (test_docs checks "
    "that the two agree)",
    ("README.md", "# 1. on the head node"): "the multi-node steps: tests/e2e/test_multinode_docs.py runs "
    "them",
    ("docs/serve.md", "make serve CONFIG="): "the tiny server that the served blocks below run against is "
    "this command's `serve run`",
    ("docs/serve.md", "controller_options:"): "a Serve config fragment; tests/unit/test_configs.py checks "
    "it against every config",
    ("docs/serve.md", "# 1. on the head node"): "the multi-node steps: tests/e2e/test_multinode_docs.py runs "
    "them",
    ("docs/amd_mori.md", "pip install -e '.[rocm]'"): "needs ROCm and amd-mori",
    ("docs/amd_mori.md", "transfer:"): "a config fragment; tests/unit/test_docs.py parses it as a pipeline "
    "config",
    ("docs/cuda_ipc.md", "from moriio_ray.transfer.cuda_devices import"): "a sketch inside a Ray actor on "
    "GPUs; tests/gpu/test_cuda_ray.py runs it",
}


def _not_run(block: Block) -> str | None:
    for (page, key), why in NOT_RUN.items():
        if block.page == page and block.first_line.startswith(key):
            return why
    return None


def _served(block: Block) -> bool:
    return "localhost:8000" in block.code


def _tiny(block: Block) -> bool:
    return re.search(r"""model["']?\s*[:=]\s*["']tiny["']""", block.code) is not None


def _script(block: Block) -> bool:
    return block.lang == "python" and not _served(block) and _not_run(block) is None


def _matches(expected: str, actual: str) -> bool:
    # `…` is any run of characters; a line break shown may be absent (curl adds none after a body)
    pattern = ".*?".join(re.escape(part) for part in expected.strip().split("…"))
    pattern = pattern.replace("\\\n", "\n?")  # re.escape writes a newline as backslash + newline
    return re.fullmatch(pattern, actual.strip(), re.S) is not None


def _make_default_config() -> Path:
    makefile = (ROOT / "Makefile").read_text()
    assert "serve run $(CONFIG)" in makefile
    line = next(ln for ln in makefile.splitlines() if ln.startswith("CONFIG ?="))
    return ROOT / line.split("?=", 1)[1].strip()


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with running(_make_default_config(), start_timeout_s=300) as proc:
        yield proc


def _run(block: Block, server: ServeProcess | None, timeout_s: float) -> str:
    code = block.code
    if server is not None:
        code = code.replace("localhost:8000", f"127.0.0.1:{server.http_port}")
    if block.lang == "bash":
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    else:
        cmd = [sys.executable, "-c", code]
    work = Path(tempfile.mkdtemp(prefix="mrr"))  # the script's own Ray temp dir, so it ends with it
    try:
        done = subprocess.run(
            ["env", f"RAY_TMPDIR={work}", "RAY_USAGE_STATS_ENABLED=0", *cmd],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=ROOT,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert done.returncode == 0, f"{block}: failed:\n{done.stderr[-3000:]}"
    return done.stdout


def _check(block: Block, out: str) -> None:
    assert out.strip(), f"{block} printed nothing"
    if block.expected is not None:
        assert _matches(block.expected, out), f"{block} shows:\n{block.expected}\nit printed:\n{out}"


@pytest.mark.timeout(30)
def test_every_block_is_run_or_named() -> None:
    blocks = doc_blocks()
    assert any(_served(b) and b.page == "README.md" for b in blocks)
    assert any(_script(b) and b.page == "README.md" for b in blocks)
    for block in blocks:
        assert _served(block) or _script(block) or is_bench_commands(block) or _not_run(block), (
            f"block not wired: {block}"
        )
    for page, key in NOT_RUN:
        assert any(b.page == page and b.first_line.startswith(key) for b in blocks), (
            f"NOT_RUN names a block that {page} lost: {key!r}"
        )
    steps = [b.code for b in blocks if b.first_line.startswith("# 1. on the head node")]
    assert len(steps) == 2 and steps[0] == steps[1], (
        "the README's multi-node steps must equal docs/serve.md's (test_multinode_docs.py runs them)"
    )


@pytest.mark.timeout(420)
def test_served_blocks_answer_as_printed(server: ServeProcess) -> None:
    blocks = [b for b in doc_blocks() if _served(b) and not _tiny(b)]
    assert blocks
    for block in blocks:
        _check(block, _run(block, server, timeout_s=120))


@pytest.mark.timeout(420)
def test_tiny_served_blocks_run(tiny_serve: Shared) -> None:
    blocks = [b for b in doc_blocks() if _served(b) and _tiny(b)]
    assert blocks
    proc = tiny_serve.get()
    for block in blocks:
        _check(block, _run(block, proc, timeout_s=120))


@pytest.mark.timeout(600)
def test_script_blocks_answer_as_printed() -> None:
    blocks = [b for b in doc_blocks() if _script(b)]
    assert {b.page for b in blocks} >= {"README.md", "docs/engine.md"}
    for block in blocks:
        _check(block, _run(block, None, timeout_s=400))
