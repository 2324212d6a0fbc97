"""Summaries, markdown tables and plots of an evaluation's records.

Each task renders its own part (task.py: `summarise`, `tables`, `miss`, `plot`, its overview
column and its methodology); this module puts the parts together and names no task.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from speedkv.evals.render import (  # noqa: F401  (metric_table, percent: imported from here)
    SHORT,
    cell,
    length_label,
    metric_table,
    percent,
    pyplot,
    wrap_spec,
)
from speedkv.evals.ruler import median_ttft_ratio, ruler_score  # noqa: F401  (leaderboard's)
from speedkv.evals.tasks import GROUPS, TASKS, get_task, group_of, kinds, reporter

_pyplot = pyplot  # the leaderboard draws with it


# -- summary ----------------------------------------------------------------------------------
def summarise(records: list[dict], methods: list[str], tasks: list[str]) -> list[dict]:
    """One row per (task, method, length): `score` and `n`, plus the task's own metrics; then
    each group's rows (RULER's average)."""
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for r in records:
        groups.setdefault((r["task"], r["method"], r["length"]), []).append(r)
    rows = []
    for task in tasks:
        lengths = sorted({length for t, _, length in groups if t == task})
        for method in methods:
            for length in lengths:
                mine = groups.get((task, method, length))
                if mine:
                    rows.append(get_task(task).summary(method, length, mine))
    return rows + [row for g in GROUPS.values() for row in g.summary_rows(rows, groups, methods)]


def _own(task: str) -> bool:
    """Reported in a section of its own: a task in no group (a group's rows are its own)."""
    return task not in GROUPS and group_of(task) is None


# -- markdown ---------------------------------------------------------------------------------
def task_tables(summary: list[dict], task: str, level: str = "##") -> str:
    return reporter(task).tables(summary, level)


def overview_columns(summary: list[dict]) -> tuple[list[str], list[tuple[str, int]], list]:
    """Methods, (task, length) columns and the headline values of the overview, NaN if absent
    (a group by its own rows: RULER by its average, its 13 tasks are in a table of their own)."""
    columns = list(
        dict.fromkeys((r["task"], r["length"]) for r in summary if group_of(r["task"]) is None)
    )
    methods = list(dict.fromkeys(r["method"] for r in summary))
    cells = {(r["method"], r["task"], r["length"]): r for r in summary}
    values = [[_headline(cells.get((m, t, n)), t) for t, n in columns] for m in methods]
    return methods, columns, values


def _headline(row: dict | None, task: str) -> float:
    value = None if row is None else row[reporter(task).overview().key]
    return math.nan if value is None else value  # absent, or a reuse the method refuses


def column_label(task: str, length: int) -> str:
    return reporter(task).overview().label + ("" if length == SHORT else f" {length_label(length)}")


def overview_table(summary: list[dict]) -> str:
    """One row per method, one column per task and length: each task's headline number."""
    methods, columns, values = overview_columns(summary)
    labels = [column_label(t, n) for t, n in columns]
    lines = ["| method | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(columns)]
    for method, row in zip(methods, values):
        cells = [
            "–" if math.isnan(v) else reporter(t).overview().format(v)
            for (t, _), v in zip(columns, row)
        ]
        lines.append(f"| `{method}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown_tables(result: dict, level: str = "##") -> str:
    tasks = list(dict.fromkeys(r["task"] for r in result["summary"]))
    own = [t for t in tasks if _own(t)]
    tables = "\n".join(task_tables(result["summary"], task, level) for task in own)
    for group in (t for t in tasks if t in GROUPS):
        tables += ("\n" if tables else "") + GROUPS[group].tables(result["summary"], level)
    reference = result.get("header", {}).get("reference")
    if reference is None:
        return tables
    note = (
        f"Fidelity and sanity compare with full attention on `{reference}`, not on the "
        "evaluated model: `full` below is the evaluated model at full depth.\n\n"
    )
    return note + tables


def misses_markdown(result: dict) -> str:
    """Every sample a method got wrong: where its needle was and what it answered."""
    lines = [
        "| task | method | length | sample | depth | prompt tokens | expected | answer |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in result["records"]:
        task = TASKS.get(r["task"])
        missed = None if task is None else task.miss(r)
        if missed is None:
            continue
        expected, answer = missed
        depth = f"{r['depth']:g}" if "depth" in r else "–"  # RULER's depths are its own
        lines.append(
            f"| {r['task']} | `{r['method']}` | {r['length']} | {r['sample']} | "
            f"{depth} | {r['prompt_tokens']} | {cell(' '.join(expected))} | {answer} |"
        )
    return "\n".join(lines) + "\n"


# -- outputs ----------------------------------------------------------------------------------
def write_outputs(result: dict, out: Path, plots: bool = True) -> None:
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "tables.md").write_text(markdown_tables(result))
    (out / "misses.md").write_text(misses_markdown(result))
    if plots:
        plot_overview(result, out)
        for kind in kinds():
            kind.plot(result, out)


def plot_overview(result: dict, out: Path) -> Path | None:
    """The overview table as one coloured grid: a row per method, a column per task and length."""
    if not result["summary"]:
        return None
    plt = pyplot()
    methods, columns, values = overview_columns(result["summary"])
    labels = [column_label(t, n).replace(" ", "\n") for t, n in columns]
    # colour = the value for accuracies; each task's column says how (perplexity ratios run from
    # 1, green, to 1.5, red)
    colour = [reporter(t).overview().colour for t, _ in columns]
    colours = [[c(v) for c, v in zip(colour, row)] for row in values]
    fig, ax = plt.subplots(figsize=(3.5 + 0.85 * len(labels), 1.2 + 0.42 * len(methods)))
    ax.imshow(colours, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            fmt = reporter(columns[j][0]).overview().format
            text = "–" if math.isnan(value) else fmt(value).rstrip("%")
            ax.text(j, i, text, ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.xaxis.tick_top()
    ax.set_yticks(range(len(methods)), [wrap_spec(m, 60) for m in methods], fontsize=7)
    ax.set_title(
        f"{result['config']['model']}: accuracy or recall % (needle tasks, sanity) and "
        "perplexity ratio to full (red from 1.5); green = as good as full",
        fontsize=8,
        pad=28,
    )
    fig.tight_layout()
    path = out / "overview.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# plots a results page shows (as write_outputs names them) and their alt text
FIGURES = {
    "overview.png": "every method's headline numbers, coloured against full",
    **{name: alt for task in TASKS.values() for name, alt in task.figures.items()},
}


# -- docs/results.md ----------------------------------------------------------------------------
def run_label(result: dict) -> str:
    """A run's model, with its adapter if it had one."""
    cfg = result["config"]
    adapter = cfg.get("adapter")
    return cfg["model"] + (f" + {Path(adapter).name}" if adapter else "")


def comparison_markdown(results: list[dict], command: str | None = None) -> str:
    """One table across several evaluations (say, models trained differently): a row per run
    and method, the tasks' numbers as columns; fidelity and sanity are against each run's
    reference, which the lines under the table name."""
    columns = list(
        dict.fromkeys(
            (r["task"], r["length"])
            for result in results
            for r in result["summary"]
            if group_of(r["task"]) is None  # a group by its own rows (RULER by its average)
        )
    )
    metrics = [
        (task, length, column.key, column.label, column.format)
        for task, length in columns
        for column in reporter(task).comparison()
    ]
    labels = [
        label + ("" if length == SHORT else f" {length_label(length)}")
        for _, length, _, label, _ in metrics
    ]
    lines = [
        "| model | method | " + " | ".join(labels) + " |",
        "|---|---|" + "---:|" * len(metrics),
    ]
    for result in results:
        cells = {(r["method"], r["task"], r["length"]): r for r in result["summary"]}
        for method in dict.fromkeys(r["method"] for r in result["summary"]):
            values = []
            for task, length, key, _, fmt in metrics:
                row = cells.get((method, task, length))
                value = None if row is None else row.get(key)
                values.append("–" if value is None else fmt(value))
            lines.append(f"| {run_label(result)} | `{method}` | " + " | ".join(values) + " |")
    lines.append("")
    for result in results:
        reference = result.get("header", {}).get("reference") or result["config"].get("reference")
        against = f"`{reference}` at full depth" if reference else "its own model at full depth"
        lines.append(f"- {run_label(result)}: fidelity and sanity against {against}.")
    page = "\n".join(lines) + "\n"
    if command:
        page = f"Regenerate with:\n\n```bash\n{command}\n```\n\n" + page
    return page


def results_markdown(
    result: dict,
    command: str | None = None,
    directory: str | None = None,
    findings: str | None = None,
    figures: list[str] | None = None,
) -> str:
    """The whole results page: what was run, how tasks are built and scored, every table.

    `findings` is hand-written markdown placed after the overview; the tables around it are
    regenerated from the records, so the reading of them survives a re-run. `figures` are
    paths, relative to the page, of FIGURES to show under the overview.
    """
    cfg = result["config"]
    versions = result.get("versions", {})
    header = result.get("header", {})
    samples = sample_counts(cfg["n"])
    lengths = ", ".join(str(n) for n in cfg["lengths"])
    compute = sum(r.get("seconds", 0.0) for r in result.get("records", [])) / 60
    lines = [
        "# Quality results",
        "",
        f"Model `{cfg['model']}` ({header.get('dtype', cfg.get('dtype'))}), essays of the "
        f"`{cfg.get('split', 'eval')}` split, seed {cfg['seed']}, prompt lengths {lengths}, "
        f"needle depths {', '.join(f'{d:g}' for d in cfg['depths'])}, "
        f"{cfg['fidelity_tokens']} teacher-forced tokens for fidelity. "
        f"Samples per task and length: {samples}.",
        "",
        f"Measured {result.get('date', '?')} with speedkv {versions.get('speedkv', '?')}, "
        f"torch {versions.get('torch', '?')}, transformers {versions.get('transformers', '?')} "
        f"on {versions.get('cpu', '?')}, {versions.get('threads', '?')} torch threads; the "
        f"runs took {compute:.0f} min in all.",
        "",
    ]
    if command:
        lines += ["Regenerate with:", "", "```bash", command, "```", ""]
    if directory:
        lines += [
            f"Per-sample records (prompt length, needle depth, expected values, answer) are in "
            f"`{directory}/results.json`, the needle samples each method missed in "
            f"`{directory}/misses.md`, depth x length heatmaps per method in "
            f"`{directory}/heatmap_*.png` and the fidelity plot in `{directory}/fidelity.png`.",
            "",
        ]
    lines += [
        "## Overview",
        "",
        "Each task's headline number per method and prompt length (details below).",
        "",
        overview_table(result["summary"]),
    ]
    if figures:
        lines += [f"![{FIGURES[Path(path).name]}]({path})\n" for path in figures]
    if findings:
        lines += [findings.strip(), ""]
    methods = methodology({r["task"] for r in result["summary"]})
    if methods:
        lines += [f"{HOW}\n\n{methods[0]}", *methods[1:]]
    lines += [markdown_tables(result, level="##")]
    return "\n".join(lines)


HOW = "## How the tasks are built and scored"


def methodology(tasks: set[str]) -> list[str]:
    """How the tasks that ran were built and scored, from each task's `methodology`: the tasks
    in no group as one text (each registered one's, in order: they build on one another) once
    any of them ran, then each group's that ran."""
    parts = []
    if any(_own(t) for t in tasks):
        own = [t.methodology for t in TASKS.values() if t.group is None and t.methodology]
        parts.append("\n".join(dict.fromkeys(own)))
    parts += [g.methodology for g in GROUPS.values() if g.name in tasks and g.methodology]
    return [part for part in parts if part]


def sample_counts(counts: dict[str, int]) -> str:
    """'niah 10, fidelity 4', with a group's tasks as one entry when they share a count."""
    parts = [f"{t} {n}" for t, n in counts.items() if group_of(t) is None]
    for group in GROUPS.values():
        theirs = {t: n for t, n in counts.items() if group_of(t) == group.name}
        if len(set(theirs.values())) == 1:
            parts.append(f"{group.title} {next(iter(theirs.values()))} per task")
        else:
            parts += [f"{t} {n}" for t, n in theirs.items()]
    return ", ".join(parts)
