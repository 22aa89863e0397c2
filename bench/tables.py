"""The report's cell formats: milliseconds, a ratio that may be undefined, a markdown table."""

from __future__ import annotations


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]
