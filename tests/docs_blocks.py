"""The project's documentation as tests read it: the pages (README.md and docs/*.md), their fenced
code blocks, the commands those blocks and the pages' inline code document, and their tables."""

from __future__ import annotations

import dataclasses
import itertools
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a documented command that runs a script of ours: `python bench/x.py ...` or `python -m bench.x ...`
COMMAND = re.compile(r"^(?:\.venv/bin/)?python3? (?:-m (?:bench|tests)\.[\w.]+|bench/\w+\.py)\b")


def page_name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@dataclasses.dataclass
class Block:
    page: str  # README.md, docs/serve.md
    line: int  # of the opening fence, 1-based
    heading: str
    lang: str
    code: str
    expected: str | None  # the text block right after it, if any

    @property
    def first_line(self) -> str:
        return self.code.strip().splitlines()[0]

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.heading}): {self.first_line!r}"


def blocks_of(path: Path) -> list[Block]:
    """The fenced code blocks of one page; a ``text`` block right after a code block (at most a
    blank line between them) is that block's expected output."""
    blocks: list[Block] = []
    heading, lines = "", path.read_text().splitlines()
    last_end = -10  # line of the last closing fence
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("```"):
            lang, body, start = line[3:].strip(), [], i
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            code = "\n".join(body) + "\n"
            if lang == "text" and blocks and blocks[-1].expected is None and start - last_end <= 2:
                blocks[-1].expected = code
            else:
                blocks.append(Block(page_name(path), start + 1, heading, lang, code, None))
            last_end = i
        i += 1
    return blocks


def doc_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks_of(page)]


def logical_lines(code: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments and blank lines dropped."""
    out, current = [], ""
    for raw in code.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        text = _strip_comment(current).strip()
        current = ""
        if text:
            out.append(text)
    return out


def _strip_comment(line: str) -> str:
    """``line`` without a trailing shell comment (a ``#`` outside quotes after a space)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def is_bench_commands(block: Block) -> bool:
    """A shell block made of our scripts' commands only (benchmarks: parsed, not run)."""
    lines = logical_lines(block.code) if block.lang in ("bash", "") else []
    return bool(lines) and all(COMMAND.match(line) for line in lines)


def documented_commands() -> list[tuple[str, list[str]]]:
    """Every command of our scripts the pages document, in code blocks and in inline code, as
    (where, argv after ``python``)."""
    found: list[tuple[str, list[str]]] = []
    for page in PAGES:
        for block in blocks_of(page):
            if block.lang not in ("bash", ""):
                continue
            for line in logical_lines(block.code):
                if COMMAND.match(line):
                    found.append((str(block), shlex.split(line)[1:]))
        for n, text in enumerate(page.read_text().splitlines(), 1):
            for inline in re.findall(r"`([^`]+)`", text):
                if COMMAND.match(inline):
                    found.append((f"{page_name(page)}:{n}", shlex.split(inline)[1:]))
    return found


@dataclasses.dataclass
class Table:
    page: str
    line: int  # of the header row
    section: str  # the text of the section that holds it (from its ## or ### heading)
    rows: list[list[str]]  # the header row first; cells stripped


def tables_of(path: Path) -> list[Table]:
    """The markdown tables of a page outside code blocks, each with the text of its section."""
    lines = path.read_text().splitlines()
    heads = [i for i, ln in enumerate(lines) if re.match(r"#{2,3} ", ln)] + [len(lines)]
    # (first line, end) of each section
    sections: list[tuple[int, int]] = [(0, heads[0]), *itertools.pairwise(heads)]
    tables, i, fenced = [], 0, False
    while i < len(lines):
        if lines[i].startswith("```"):
            fenced = not fenced
        divider = i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|$", lines[i + 1])
        if not fenced and lines[i].startswith("|") and divider:
            start, rows = i, [_cells(lines[i])]
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            lo, hi = next((a, b) for a, b in sections if a <= start < b)
            tables.append(Table(page_name(path), start + 1, "\n".join(lines[lo:hi]), rows))
            continue
        i += 1
    return tables


def _cells(row: str) -> list[str]:
    inner = row.strip()[1:-1] if row.strip().endswith("|") else row.strip()[1:]
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", inner)]
