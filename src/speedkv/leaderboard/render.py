"""Writing a board: leaderboard.md, results.json and the Pareto plot from the runs under --work
(archived parts restored first, kvpress parts' records brought up to date) and the published
rows of sweeps whose runs are elsewhere; with --docs, the fenced copy of its tables in a docs
page too."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from speedkv.leaderboard.archives import restore_missing_parts
from speedkv.leaderboard.lanes import refresh_peer_records
from speedkv.leaderboard.plans import Plan, sweeps
from speedkv.leaderboard.plot import plot_pareto
from speedkv.leaderboard.published import (
    bench_ttft,
    published_bench_ttft,
    rows_from_json,
    to_json,
    with_published,
)
from speedkv.leaderboard.rows import (
    AGNOSTIC,
    AWARE,
    SETTING_LABELS,
    answers_by_machine,
    rows_from_runs,
)
from speedkv.leaderboard.tables import (
    equal_kv_table,
    leaderboard_table,
    own_reference_table,
    task_table,
)


def docs_markers(name: str) -> tuple[str, str]:
    """The comments that fence a docs page's copy of one leaderboard's tables."""
    return (f"<!-- ruler tables {name}: written by speedkv leaderboard render "
            "--docs; edit the prose around them -->", f"<!-- /ruler tables {name} -->")  # fmt: skip


def refresh_docs(page: str, name: str, tables: str) -> str:
    """`page` with the fenced tables of leaderboard `name` replaced by `tables`."""
    begin, end = docs_markers(name)
    if page.count(begin) != 1 or page.count(end) != 1 or page.index(begin) > page.index(end):
        raise SystemExit(f"the page has no single fenced region for {name}; fence the tables "
                         f"with\n{begin}\n...\n{end}")  # fmt: skip
    head, rest = page.split(begin)
    return head + begin + "\n\n" + tables.strip() + "\n\n" + end + rest.split(end, 1)[1]


def render(args, plan: Plan, work: Path, out: Path) -> None:
    restore_missing_parts(out, work)
    refresh_peer_records(args, plan, work)
    dirs = sorted(p.parent for p in work.glob("*/records.jsonl"))
    published_file = out / "results.json"
    published = (
        rows_from_json(json.loads(published_file.read_text())) if published_file.exists() else []
    )
    if not dirs and not published:
        raise SystemExit(
            f"no runs under {work}: run some sweeps first (speedkv leaderboard run base)"
        )
    ttft_file = work / "ttft" / "results.json"
    # the quiet bench's ratios: this machine's `ttft` run, else those the published board took
    # from the machine that ran it
    ttft = bench_ttft(ttft_file) if ttft_file.exists() else published_bench_ttft(published)
    # rows whose runs are not here (finished on another machine) keep their published figures
    references = [
        d for s in sweeps(plan).values() if s.reference_only for d in work.glob(f"{s.name}-*of*")
    ]
    rows, carried = with_published(rows_from_runs(dirs, ttft, references), published)
    if carried:
        print(f"{len(carried)} rows as published in {published_file} (no runs of theirs under "
              f"{work})", file=sys.stderr)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    title = f"{args.model}, RULER at {args.length} tokens"
    plot = plot_pareto(rows, args.length, out / "pareto.png", title)
    board = leaderboard_table(rows, args.length)
    per_task = {  # the settings with rows at this length
        setting: task_table(rows, args.length, setting)
        for setting in (AWARE, AGNOSTIC)
        if any(r.setting == setting and r.length == args.length for r in rows)
    }
    parts = [
        f"# {title}\n",
        f"Generated {time.strftime('%Y-%m-%d %H:%M')} by `speedkv leaderboard render` "
        "from "
        + " and ".join(
            ([f"{len(dirs)} runs under {work}"] if dirs else [])
            + ([f"{len(carried)} rows as published before"] if carried else [])
        )
        + ". Scores in percent (RULER's metric per "
        "task; the average is the mean of the 13 tasks, given once every task has samples; ± is "
        "its 95 % margin from the samples' spread in each task). "
        "KV x: cache held at the first token against full attention's on the same prompts. "
        "TTFT x: "
        + (
            "from a quiet `speedkv bench` at this length for speedkv's methods; "
            if any(r.ttft_source == "bench" for r in rows)
            else ""
        )
        + "values marked * are medians of the per-sample ratios in the sweeps (kvpress's "
        "against its own pipeline without a press).\n",
        "## Leaderboard\n",
        board,
    ]
    versus = equal_kv_table(rows, args.length)
    if versus:
        parts += [
            "## SPEED against kvpress at equal KV\n",
            "Each difference comes with its own 95 % margin: paired on the samples both rows "
            "answered where both kept their per-sample scores (marked), else the two rows' "
            "margins combined as independent.\n",
            versus,
        ]
    own = own_reference_table(d for d in references if d in dirs)
    if own:
        parts += [
            "## Presses against their own no-press answers\n",
            "A press whose sweep answers its own press=None reference (KVzip's) against it, on "
            "the same samples, made in the same process on the same CPU.\n",
            own,
        ]
    for setting, table in per_task.items():
        parts += [f"## Per task, {SETTING_LABELS[setting]}\n", table]
    if plot:
        parts += ["## Pareto front\n", f"![RULER against KV and TTFT]({plot.name})\n"]
    hours = sum(r.seconds for r in rows) / 3600
    parts += [f"Samples' wall time, all rows: {hours:.1f} h (CPU shared by the parallel parts).\n"]
    by_sweep: dict[str, list[Path]] = {}
    for directory in dirs:  # a sweep's parts are SWEEP-1ofN ... SWEEP-NofN
        by_sweep.setdefault(directory.name.rsplit("-", 1)[0], []).append(directory)
    lines = []
    for sweep, parts_of_sweep in by_sweep.items():
        machines = answers_by_machine(parts_of_sweep)
        listed = "; ".join(f"{name}: {n} in {s / 3600:.1f} h" for name, (n, s) in machines.items())
        lines.append(f"- `{sweep}`: {listed}\n")
    if lines:
        parts += [f"Answers under {work} by sweep and the CPU that made them, with their "
                  "samples' wall time:\n", "".join(lines)]  # fmt: skip
    (out / "leaderboard.md").write_text("\n".join(parts))
    if args.docs:
        captions = {AWARE: "Per task, question in view (RULER's metric, percent):",
                    AGNOSTIC: "Per task, context cached before the question:"}  # fmt: skip
        tables = [board]
        if versus:
            tables += ["SPEED against kvpress's presses at the same KV ratio:\n", versus]
        if own:
            tables += ["Presses that answer their own no-press reference, against it on the "
                       "same samples and CPU:\n", own]  # fmt: skip
        for setting, table in per_task.items():
            tables += [captions[setting] + "\n", table]
        if plot:
            image = os.path.relpath(plot, args.docs.parent)
            tables += [f"![RULER average against KV and TTFT ratio, Pareto front]({image})"]
        name = f"{args.model}-{args.length}"
        args.docs.write_text(refresh_docs(args.docs.read_text(), name, "\n".join(tables)))
        print(args.docs)
    (out / "results.json").write_text(json.dumps(to_json(rows), indent=1))
    print(out / "leaderboard.md")
