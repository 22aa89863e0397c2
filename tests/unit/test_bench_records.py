"""bench/results keeps one current record per table, each naming its commit, machine and command;
run_record writes that head into every new record; every bench script's parser builds without
running anything. No Ray."""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
from pathlib import Path

import pytest

from bench.common import ROOT, command_line, machine_line, repo_path, run_record

RESULTS = ROOT / "bench" / "results"
RECORD_KEYS = ("commit", "machine", "command")


def _check_command(command: str) -> list[str]:
    problems = []
    if not command.startswith(("python bench/", "python -m bench.")):
        problems.append(f"command {command!r} starts with neither 'python bench/' nor 'python -m bench.'")
    if any(word.startswith(("/", "~")) for word in shlex.split(command)):
        problems.append(f"command {command!r} names a machine path")
    return problems


@pytest.mark.timeout(30)
def test_every_record_names_its_commit_machine_and_command() -> None:
    paths = sorted(RESULTS.glob("*.json"))
    assert paths
    problems = []
    for path in paths:
        doc = json.loads(path.read_text())
        record = doc.get("record")
        if not isinstance(record, dict) or next(iter(doc)) != "record":
            problems.append(f"{path.name}: no 'record' as its first key")
            continue
        for key in RECORD_KEYS:
            if not isinstance(record.get(key), str) or not record[key].strip():
                problems.append(f"{path.name}: record.{key} is missing or empty")
        problems += [f"{path.name}: {p}" for p in _check_command(str(record.get("command", "")))]
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(30)
def test_no_orphan_files_and_every_log_has_its_header() -> None:
    problems = []
    for path in sorted(RESULTS.iterdir()):
        if path.suffix in (".md", ".png"):
            if not path.with_suffix(".json").exists():
                problems.append(f"{path.name}: no {path.stem}.json beside it")
        elif path.suffix == ".txt":
            head = path.read_text().splitlines()[: len(RECORD_KEYS)]
            for line, key in zip(head + [""] * len(RECORD_KEYS), RECORD_KEYS, strict=False):
                if not line.startswith(f"# {key}: ") or not line.removeprefix(f"# {key}: ").strip():
                    problems.append(f"{path.name}: its first lines do not give '# {key}: ...'")
        elif path.suffix != ".json":
            problems.append(f"{path.name}: neither a record (.json, .md, .png) nor a test log (.txt)")
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(30)
def test_run_record_writes_the_command_of_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # no torch: the record without GPUs, quickly
    doc = run_record("unit", {"out": ROOT / "x", "config": ROOT / "configs" / "tiny_1p1d_cpu.yaml"})
    assert next(iter(doc)) == "record"
    record = doc["record"]
    assert all(isinstance(record[k], str) and record[k] for k in RECORD_KEYS)
    assert record["commit"] == doc["commit"] and "no GPU" in record["machine"]
    words = shlex.split(record["command"])
    orig = getattr(sys, "orig_argv", [sys.executable, *sys.argv])
    running = ["-m", orig[2]] if orig[1] == "-m" else [repo_path(orig[1])]
    assert words[0] == "python" and words[1 : 1 + len(running)] == running
    assert doc["args"]["config"] == "configs/tiny_1p1d_cpu.yaml" and "out" not in doc["args"]


@pytest.mark.timeout(30)
def test_a_bench_scripts_command_as_typed_in_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    script = ["/opt/env/bin/python3", str(ROOT / "bench" / "serving.py"), "--tag", "gpu"]
    monkeypatch.setattr(sys, "orig_argv", [*script, "--out", "/data/runs/out", "--set", "model.path=/m/x"])
    record = run_record("serving", {})["record"]
    assert record["command"] == "python bench/serving.py --tag gpu --out out --set model.path=x"
    assert not _check_command(record["command"])
    module = ["python", "-m", "bench.control_plane", "--sizes", "16,128", "--out=bench/results/cp.json"]
    monkeypatch.chdir(ROOT)
    assert command_line(module) == "python -m bench.control_plane --sizes 16,128 --out=bench/results/cp.json"
    monkeypatch.chdir(ROOT / "bench")  # run from inside the tree: the paths still from the root
    shown = command_line(["python", "serving.py", "--config", "../configs/tiny_1p1d_cpu.yaml", "--tag", "x"])
    assert shown == "python bench/serving.py --config configs/tiny_1p1d_cpu.yaml --tag x"
    assert command_line(["python", "t.py", "--variant", '{"a": 1}']) == """python t.py --variant '{"a": 1}'"""


@pytest.mark.timeout(10)
def test_the_machine_in_one_line() -> None:
    assert machine_line("Intel Xeon", 16, ["NVIDIA H200"]) == "one NVIDIA H200, 16 host cores (Intel Xeon)"
    assert machine_line("X", 64, ["NVIDIA H100"] * 4) == "4 NVIDIA H100, 64 host cores (X)"
    assert machine_line("AMD EPYC", 2, []) == "2 cores (AMD EPYC), no GPU"


def _scripts() -> list[Path]:
    """The bench scripts that parse a command line of their own."""
    return [
        p
        for p in sorted((ROOT / "bench").glob("*.py"))
        if 'if __name__ == "__main__":' in (text := p.read_text()) and "argparse" in text
    ]


@pytest.mark.timeout(120)
def test_every_bench_scripts_parser_builds_without_running() -> None:
    scripts = _scripts()
    assert {"serving", "control_plane", "engine_bench", "transfer_bench", "report"} <= {
        p.stem for p in scripts
    }
    for path in scripts:
        module = importlib.import_module(f"bench.{path.stem}")
        assert hasattr(module, "parser"), f"bench/{path.name} has no parser()"
        parser = module.parser()
        assert isinstance(parser, argparse.ArgumentParser)
        assert parser.format_help()
