"""Every code block of README.md is run (or named here with the test that covers it) and, where the
README shows an answer, gives that answer.

A block directly followed by a ``text`` block prints that text; in it ``…`` stands for any run of
characters (ids, timestamps). The curl and ``openai`` blocks talk to ``serve run`` on the config
that ``make serve`` serves (the Makefile's ``CONFIG``), started once for the module on a free
port; the "From Python" block runs as a script with its own local Ray. Blocks that cannot run here
(GPU benchmarks, multi-minute benchmarks, ``make test`` itself) are listed in ``NOT_RUN`` with the
reason; a block that is in neither list fails the test, so a new README example must be wired in.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.launch import ServeProcess
from tests.e2e.serving import running

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

# first line of a block -> why this test does not run it
NOT_RUN = {
    "make serve": "make test runs this test; make serve is `serve run $(CONFIG)`, which the fixture runs",
    "python -m bench.transfer_bench": "a benchmark of minutes; its record: bench/results/transfer_bench.json",
    "python bench/transfer_gpu_bench.py": "needs two NVIDIA GPUs",
    "python bench/engine_bench.py": "needs an NVIDIA GPU",
    "python bench/serving.py": "a benchmark of minutes (its GPU run needs an H200); records: "
    "bench/results/serving_*.json, handoff_*, prefix_*, n_choices_*, serve_cpu.json",
    "python -m bench.control_plane": "a benchmark of minutes; tests/integration/test_control_plane.py "
    "runs it bounded at N = 64; its record: bench/results/control_plane.json",
    "controller_options:": "a Serve config fragment; tests/unit/test_configs.py checks it in every config",
    "# 1. on the head node": "the multi-node steps: tests/e2e/test_multinode_docs.py runs them (same block)",
}


@dataclasses.dataclass
class Block:
    heading: str
    lang: str
    code: str
    expected: str | None  # the text block right after it, if any

    @property
    def first_line(self) -> str:
        return self.code.strip().splitlines()[0]


def readme_blocks() -> list[Block]:
    blocks: list[Block] = []
    heading, lines = "", README.read_text().splitlines()
    last_end = -10  # line of the last closing fence
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            heading = line.lstrip("#").strip()
        if line.startswith("```"):
            lang, body, start = line[3:].strip(), [], i
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            code = "\n".join(body) + "\n"
            # an output block follows its code block, with at most a blank line between them
            if lang == "text" and blocks and blocks[-1].expected is None and start - last_end <= 2:
                blocks[-1].expected = code
            else:
                blocks.append(Block(heading, lang, code, None))
            last_end = i
        i += 1
    return blocks


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


def _not_run(block: Block) -> str | None:
    return next((why for key, why in NOT_RUN.items() if block.first_line.startswith(key)), None)


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
    assert done.returncode == 0, f"{block.heading}: {block.first_line!r} failed:\n{done.stderr[-3000:]}"
    return done.stdout


def _check(block: Block, out: str) -> None:
    assert out.strip(), f"{block.first_line!r} printed nothing"
    if block.expected is not None:
        assert _matches(block.expected, out), f"README shows:\n{block.expected}\nit printed:\n{out}"


@pytest.mark.timeout(30)
def test_every_block_is_run_or_named() -> None:
    blocks = readme_blocks()
    served = [b for b in blocks if "localhost:8000" in b.code]
    scripts = [b for b in blocks if b.heading == "From Python"]
    assert served and scripts
    for block in blocks:
        assert block in served or block in scripts or _not_run(block), (
            f"README block not wired: {block.first_line!r}"
        )
    for key in NOT_RUN:
        assert any(b.first_line.startswith(key) for b in blocks), (
            f"NOT_RUN names a block the README lost: {key!r}"
        )
    steps = next(b for b in blocks if b.first_line.startswith("# 1. on the head node")).code
    serve_md = (ROOT / "docs" / "serve.md").read_text()
    assert steps in serve_md, "the README's multi-node steps must equal docs/serve.md's (which a test runs)"


@pytest.mark.timeout(420)
def test_served_blocks_answer_as_printed(server: ServeProcess) -> None:
    for block in (b for b in readme_blocks() if "localhost:8000" in b.code):
        _check(block, _run(block, server, timeout_s=120))


@pytest.mark.timeout(420)
def test_from_python_block_answers_as_printed() -> None:
    for block in (b for b in readme_blocks() if b.heading == "From Python"):
        _check(block, _run(block, None, timeout_s=400))
