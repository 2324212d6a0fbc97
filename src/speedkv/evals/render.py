"""Helpers every task's report part uses: number formats, the methods x lengths table, answer
cells, means that allow no records, and matplotlib set up for files."""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Iterable
from types import ModuleType

SHORT = 0  # the length recorded for prompts that each have their own length (sanity's)


def mean(values: Iterable[float]) -> float | None:
    """The mean, or None when there is nothing to average (a summary of no records)."""
    values = list(values)
    return statistics.fmean(values) if values else None


def percent(value: float) -> str:
    return f"{100 * value:.0f}%"


def percent_or_refused(value: float | None) -> str:
    return "refuses" if value is None else percent(value)


def length_label(length: int) -> str:
    if length == SHORT:
        return "short"
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def metric_table(summary: list[dict], task: str, key: str, fmt: Callable[[float], str]) -> str:
    """Rows = methods (in run order), columns = lengths; each cell `fmt(row[key])` (n)."""
    rows = [r for r in summary if r["task"] == task]
    lengths = sorted({r["length"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cells = {(r["method"], r["length"]): r for r in rows}
    lines = [
        "| method | " + " | ".join(length_label(n) for n in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for method in methods:
        values = []
        for n in lengths:
            row = cells.get((method, n))
            values.append("–" if row is None else f"{fmt(row[key])} ({row['n']})")
        lines.append(f"| `{method}` | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def cell(answer: str, width: int = 80) -> str:
    """An answer on one line, cut to `width` characters, safe in a table."""
    answer = " ".join(answer.split())
    answer = answer[: width - 3] + "..." if len(answer) > width else answer
    return answer.replace("|", "/")


# -- plots --------------------------------------------------------------------------------------
def slug(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", spec).strip("_")


def wrap_spec(spec: str, width: int = 40) -> str:
    """A long method spec over several lines, broken after commas, for plot labels."""
    lines, line = [], ""
    for part in re.split(r"(?<=,)", spec):
        if line and len(line) + len(part) > width:
            lines.append(line)
            line = ""
        line += part
    return "\n".join([*lines, line])


def pyplot() -> ModuleType:
    """matplotlib's pyplot, drawing to files (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
