"""A board's tables: the headline leaderboard, SPEED against kvpress at equal KV, the presses
against their own no-press answers, and the per-task scores."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from pathlib import Path

from speedkv.evals import ruler
from speedkv.evals.ruler import ruler_score
from speedkv.leaderboard.rows import (
    AGNOSTIC,
    AWARE,
    KV_MATCH,
    KVPRESS_NONE,
    SETTING_LABELS,
    Row,
    critical_value,
    rows_from_runs,
)


def _pct(value: float | None) -> str:
    return "–" if value is None or math.isnan(value) else ruler_score(value)


def leaderboard_table(rows: list[Row], length: int) -> str:
    """The headline table at one length: a row per method and adapter, its average in each
    setting, KV and TTFT ratios; best-first within the untrained, trained and kvpress rows."""
    mine = [r for r in rows if r.length == length]
    # a method (one spec, one adapter) is ranked once every task has a sample in a setting;
    # an unranked one sharing a ranked one's label is named by its spec too
    ranked = {_key(r) for r in mine if r.average is not None}
    ranked_labels = {r.label for r in mine if _key(r) in ranked}
    partial_names = list(
        dict.fromkeys(
            f"{r.label} (`{_short_spec(r.method)}`)" if r.label in ranked_labels else r.label
            for r in sorted(mine, key=lambda r: r.method)
            if _key(r) not in ranked
        )
    )
    mine = [r for r in mine if _key(r) in ranked]
    keys = list(dict.fromkeys(_key(r) for r in mine))
    lines = [
        "| method | adapter | KV x | TTFT x | RULER avg ± 95 %, query-aware "
        "| RULER avg ± 95 %, query-agnostic | samples per task |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for engine, adapter, method in keys:
        both = {
            r.setting: r
            for r in mine
            if (r.engine, r.adapter, r.method) == (engine, adapter, method)
        }
        first = both.get(AWARE) or both[AGNOSTIC]
        samples = sorted({r.min_samples for r in both.values()})
        ttft = (
            "–"
            if first.ttft_ratio is None
            else f"{first.ttft_ratio:.3f}" + ("" if first.ttft_source == "bench" else "*")
        )
        lines.append(
            f"| {first.label} (`{_short_spec(method)}`) | {_adapter_cell(adapter)} "
            f"| {first.kv_ratio:.3f} | {ttft} "
            f"| {_with_margin(both.get(AWARE))} | {_with_margin(both.get(AGNOSTIC))} "
            f"| {'/'.join(str(s) for s in samples)} |"
        )
    if partial_names:
        lines.append(f"\nNot every task measured yet: {', '.join(partial_names)}.")
    return "\n".join(lines) + "\n"


def _with_margin(row: Row | None) -> str:
    if row is None or row.average is None:
        return "–"
    return f"{_pct(row.average)} ± {100 * row.margin:.1f}"


def difference(a: Row, b: Row) -> tuple[float, float, bool]:
    """a's average less b's, the 95 % margin of that difference, and whether it is paired.
    Paired where both rows kept their per-sample scores and share at least two samples in every
    task: each task's mean difference over the samples both answered, with its spread, which
    is far smaller than two rows' own spreads where the methods agree on most samples.
    Otherwise the two margins combined as independent."""
    by_task = paired_by_task(a, b)
    if by_task is not None and all(len(by_task.get(t, ())) >= 2 for t in ruler.TASKS):
        tasks = len(ruler.TASKS)
        gap = sum(statistics.fmean(by_task[t]) for t in ruler.TASKS) / tasks
        parts = [
            (statistics.variance(by_task[t]) / len(by_task[t]), len(by_task[t]))
            for t in ruler.TASKS
        ]
        spread = sum(v for v, _ in parts)
        return gap, critical_value(parts) * math.sqrt(spread) / tasks, True
    return a.average - b.average, math.hypot(a.margin, b.margin), False


def paired_by_task(a: Row, b: Row) -> dict[str, list[float]] | None:
    """a's score less b's on each sample both answered, by task; None unless both rows kept
    their per-sample scores."""
    mine, theirs = a.extra.get("per_sample"), b.extra.get("per_sample")
    if not (mine and theirs):
        return None
    by_task: dict[str, list[float]] = {}
    for key in mine.keys() & theirs.keys():
        by_task.setdefault(key[0], []).append(mine[key] - theirs[key])
    return by_task


def equal_kv_table(rows: list[Row], length: int) -> str:
    """SPEED against every kvpress press that holds the same share of the cache, in each
    setting: both averages with their 95 % margins and the difference with its own (paired
    where both rows kept their samples, see `difference`). A difference counts as told apart
    when it exceeds its margin. Empty when no press matches."""
    ranked = [r for r in rows if r.length == length and r.average is not None]
    speed = [r for r in ranked if r.engine == "speedkv" and r.method.startswith("speed:")]
    lines = []
    for mine in sorted(
        speed, key=lambda r: (r.setting != AWARE, r.adapter is not None, r.kv_ratio)
    ):
        presses = [
            r
            for r in ranked
            if r.engine == "kvpress"
            and r.setting == mine.setting
            and abs(r.kv_ratio - mine.kv_ratio) <= KV_MATCH
        ]
        for press in sorted(presses, key=lambda r: -r.average):
            gap, noise, paired = difference(mine, press)
            gap, noise = 100 * gap, 100 * noise  # points
            verdict = (
                ("SPEED ahead" if gap > 0 else "SPEED behind")
                if abs(gap) > noise
                else "within the margins"
            ) + (" (paired)" if paired else "")
            lines.append(
                f"| {SETTING_LABELS[mine.setting]} | {mine.kv_ratio:.3f} | {mine.label} "
                f"| {_with_margin(mine)} | {press.label} | {_with_margin(press)} "
                f"| {gap:+.1f} ± {noise:.1f} | {verdict} |"
            )
    if not lines:
        return ""
    # the engines differ (bfloat16 kernels, prompt handling), so each side's own ceiling too
    ceilings = [
        f"{engine} {SETTING_LABELS[r.setting]} {_with_margin(r)}"
        for engine, method in (("speedkv", "full"), ("kvpress", KVPRESS_NONE))
        for r in ranked
        if r.engine == engine and r.method == method and not r.adapter
    ]
    head = [
        "| setting | KV x | SPEED row | its RULER avg | kvpress press | its RULER avg "
        "| difference, points | 95 % |",
        "|---|---:|---|---:|---|---:|---:|---|",
    ]
    ceiling = f"\nFull attention in each engine: {'; '.join(ceilings)}.\n" if ceilings else ""
    return "\n".join(head + lines) + "\n" + ceiling


def own_reference_table(directories: Iterable[Path]) -> str:
    """Each press of runs that answer their own no-press reference (the kvzip sweep) against
    that reference on the same samples, made on the same CPU in the same process: both averages,
    the paired difference with its 95 % margin, how many answers are word for word the
    reference's, and the median per-sample TTFT ratio on each CPU that made them (a sweep may
    resume on another machine). Empty without such runs."""
    rows = rows_from_runs(directories)
    references = {r.setting: r for r in rows if r.method == KVPRESS_NONE}
    lines = []
    for row in rows:
        own = references.get(row.setting)
        if row.method == KVPRESS_NONE or own is None or row.average is None:
            continue
        mine, theirs = row.extra["records"], own.extra["records"]
        pairs = [(mine[k], theirs[k]) for k in sorted(mine.keys() & theirs.keys())]
        same = sum(pressed["answer"] == reference["answer"] for pressed, reference in pairs)
        by_machine: dict[str, list[float]] = {}
        for pressed, _ in pairs:
            if pressed.get("ttft_ratio") is not None:
                machine = pressed.get("machine") or "CPU not recorded"
                by_machine.setdefault(machine, []).append(pressed["ttft_ratio"])
        ttft = "; ".join(
            f"{statistics.median(v):.1f} on {machine} ({len(v)})"
            for machine, v in sorted(by_machine.items(), key=lambda item: -len(item[1]))
        )
        gap, noise, paired = difference(row, own)
        lines.append(
            f"| {SETTING_LABELS[row.setting]} | {row.label} | {row.kv_ratio:.3f} "
            f"| {_with_margin(row)} | {_with_margin(own)} "
            f"| {100 * gap:+.1f} ± {100 * noise:.1f}{'' if paired else ' (unpaired)'} "
            f"| {same} of {len(pairs)} | {ttft or '-'} |"
        )
    if not lines:
        return ""
    head = [
        "| setting | press | KV x | its RULER avg | no press, same samples | difference, points "
        "| answers word for word the no-press ones | TTFT x, median per sample (samples) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    return "\n".join(head + lines) + "\n"


def _key(row: Row) -> tuple:
    """What makes a line of the leaderboard: both settings of one method share it."""
    return (row.engine, row.adapter, row.method)


def task_table(rows: list[Row], length: int, setting: str) -> str:
    """Per-task scores (percent) in one setting at one length."""
    mine = [r for r in rows if r.length == length and r.setting == setting]
    names = [ruler.ruler_name(t) for t in ruler.TASKS]
    lines = [
        "| method | adapter | " + " | ".join(names) + " | avg |",
        "|---|---|" + "---:|" * (len(names) + 1),
    ]
    for r in mine:
        cells = [_pct(r.scores.get(t)) if r.counts.get(t) else "–" for t in ruler.TASKS]
        lines.append(
            f"| {r.label} | {_adapter_cell(r.adapter)} | "
            + " | ".join(cells)
            + f" | {_pct(r.average)} |"
        )
    return "\n".join(lines) + "\n"


def _adapter_cell(adapter: str | None) -> str:
    return Path(adapter).name if adapter else "none"


def _short_spec(method: str) -> str:
    """The spec without options at their defaults that every row shares."""
    return method.replace(",selfonly=false", "")
