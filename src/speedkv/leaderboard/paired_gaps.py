"""RULER averages and paired gaps between two `speedkv eval --tasks ruler` runs on the same
samples (same seed and length), with the leaderboard's 95 % margins (Student's t below 10
samples a task).

    .venv/bin/speedkv measure paired-gaps BASE_DIR/records.jsonl TRAINED_DIR/records.jsonl \\
        --speed "speed:lcut=22,anchors=bos,deep=1,selfonly=false"

BASE is the untrained model's run, TRAINED (optional) the adapter's; each holds `full` and one
SPEED spec, spelled as the records spell it (`--base-speed` where BASE's differs). It prints the
average of each of the (up to four) rows the runs hold, then the gaps between them, each paired
on the samples both answered where every task shares two (speedkv.leaderboard.tables.difference).
A row the records lack is left out with the gaps that need it (a note on stderr says which); a
row short of a task is printed as incomplete, without gaps. `--per-task` adds a table of every
task's score in each row and SPEED's per-task gaps, and names the task SPEED loses most on.
`--press RECORDS --press-method SPEC` adds a compression method's row from another run on the
same samples (a kvpress run on the same weights, benchmarks/kvpress_peer.py) and SPEED's paired
gap to it, so that SPEED and the press are compared on equal training.

It sits in the leaderboard layer, not in speedkv.bench.measure: its margins are the
leaderboard's (speedkv.leaderboard.rows and tables), which the bench layer may not import.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from speedkv.errors import UserError
from speedkv.evals import ruler
from speedkv.leaderboard.rows import Row, read_records
from speedkv.leaderboard.tables import difference, paired_by_task

# (a, b): a's average less b's, in this order; a gap whose rows are not both there is skipped
GAPS = (
    ("trained SPEED", "untrained full"),
    ("trained SPEED", "trained full"),
    ("trained SPEED", "untrained SPEED"),
    ("trained full", "untrained full"),
    ("untrained SPEED", "untrained full"),
    ("trained SPEED", "press"),
    ("untrained SPEED", "press"),
)


def per_sample(records: list[dict], method: str) -> dict[tuple[str, int], float]:
    """(task, sample) -> score of `method`'s records; a sample recorded twice (a resumed run)
    counts once, its latest."""
    return {(r["task"], r["sample"]): r["score"] for r in records if r.get("method") == method}


def as_row(scores: dict[tuple[str, int], float]) -> Row:
    """A leaderboard Row from per-sample scores, keeping them so `difference` can pair them.
    Only the averages and margins are read: the cost fields are placeholders."""
    by_task = {t: [v for (task, _), v in scores.items() if task == t] for t in ruler.TASKS}
    return Row(
        method="",
        engine="speedkv",
        adapter=None,
        setting="aware",
        length=0,
        # a task without samples has no score: the row is then incomplete (average None)
        scores={t: statistics.fmean(v) for t, v in by_task.items() if v},
        counts={t: len(v) for t, v in by_task.items()},
        kv_ratio=1.0,
        ttft_ratio=None,
        extra={"per_sample": scores},
    )


def read_rows(
    base: Path,
    trained: Path | None,
    speed: str,
    base_speed: str | None = None,
    press: tuple[Path, str] | None = None,
) -> tuple[dict[str, Row], list[str]]:
    """The rows the runs hold, by name (untrained/trained full/SPEED, and `press`: a records
    file and the method in it), and a note for each row without records. UserError when no
    run holds any of them."""
    paths = (base,) if trained is None else (base, trained)
    if press is not None:
        paths += (press[0],)
    runs = {path: read_records(path)[1] for path in paths}
    # what each run does hold, for the note: a misspelt --speed is the usual reason
    held = {path: ", ".join(sorted({r["method"] for r in runs[path]})) or "none" for path in runs}
    wanted = {
        "untrained full": (base, "full"),
        "untrained SPEED": (base, base_speed or speed),
    }
    if trained is not None:
        wanted |= {"trained full": (trained, "full"), "trained SPEED": (trained, speed)}
    if press is not None:
        wanted["press"] = press
    rows, notes = {}, []
    for name, (path, method) in wanted.items():
        scores = per_sample(runs[path], method)
        if scores:
            rows[name] = as_row(scores)
        else:  # a run of `full` alone is usual (no untrained SPEED row): say so, go on
            notes.append(
                f"{name} left out: {path} holds no RULER records of {method!r} "
                f"(its methods: {held[path]})"
            )
    if not rows:
        raise UserError(
            f"neither run holds RULER records of 'full' or {speed!r}; "
            + "; ".join(f"{path} holds: {methods}" for path, methods in held.items())
        )
    return rows, notes


def report(rows: dict[str, Row]) -> list[str]:
    """Each row's average ± margin, then each gap ± its margin, in points."""
    lines = []
    for name, row in rows.items():
        if row.average is None:
            tasks = sum(1 for t in ruler.TASKS if row.counts.get(t))
            lines.append(f"{name}: incomplete ({tasks} of {len(ruler.TASKS)} tasks answered)")
        else:
            lines.append(f"{name}: {100 * row.average:.1f} ± {100 * row.margin:.1f}")
    for a, b in GAPS:
        if a not in rows or b not in rows or None in (rows[a].average, rows[b].average):
            continue
        gap, margin, paired = difference(rows[a], rows[b])
        lines.append(
            f"{a} - {b}: {100 * gap:+.1f} ± {100 * margin:.1f}{' (paired)' if paired else ''}"
        )
    return lines


# per-task columns: SPEED's row (trained where there is one) against each full row
TASK_GAPS = (("untrained full", "untrained full"), ("trained full", "its own full"))


def per_task(rows: dict[str, Row]) -> list[str]:
    """A markdown table of each task's score in every row, in points, and SPEED's gap to each
    full row on the samples both answered; then the task SPEED loses most on against
    untrained full (the issue's per-task bound is read from it)."""
    speed = "trained SPEED" if "trained SPEED" in rows else "untrained SPEED"
    gaps = [(full, label) for full, label in TASK_GAPS if full in rows and speed in rows]
    if "trained SPEED" not in rows:  # one run: its full is SPEED's own
        gaps = [(full, "full") for full, _ in gaps[:1]]
    names = list(rows)
    head = ["task", *names, *(f"SPEED - {label}" for _, label in gaps)]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    # each full row's paired per-sample differences, by task, once
    paired = {full: paired_by_task(rows[speed], rows[full]) or {} for full, _ in gaps}
    worst: tuple[float, str] | None = None
    for task in ruler.TASKS:
        cells = [task.removeprefix(ruler.PREFIX)]
        for name in names:
            score = rows[name].scores.get(task)
            cells.append("" if score is None else f"{100 * score:.1f}")
        for full, _ in gaps:
            shared = paired[full].get(task)
            gap = statistics.fmean(shared) if shared else None
            cells.append("" if gap is None else f"{100 * gap:+.1f}")
            if gap is not None and full == "untrained full" and (worst is None or gap < worst[0]):
                worst = (gap, cells[0])
        lines.append("| " + " | ".join(cells) + " |")
    if worst is not None:
        lines.append(
            f"largest per-task loss of {speed} against untrained full: "
            f"{worst[1]} {100 * worst[0]:+.1f}"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="speedkv measure paired-gaps", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("base", type=Path, help="the untrained model's records.jsonl")
    parser.add_argument(
        "trained",
        type=Path,
        nargs="?",
        help="the adapter's records.jsonl (without it: BASE's own rows and SPEED's gap to full)",
    )
    parser.add_argument("--speed", required=True, help="the SPEED spec as the records spell it")
    parser.add_argument("--base-speed", help="BASE's SPEED spec, where it differs from --speed")
    parser.add_argument(
        "--press",
        type=Path,
        help="a compression method's records.jsonl on the same samples (for example a kvpress "
        "run on the same weights): its row and SPEED's paired gap to it",
    )
    parser.add_argument("--press-method", help="the method in --press, as its records spell it")
    parser.add_argument(
        "--per-task",
        action="store_true",
        help="also a markdown table of every task's score and SPEED's gaps to full, and the "
        "task SPEED loses most on",
    )
    args = parser.parse_args(argv)
    for path in (args.base, args.trained, args.press):
        if path is not None and not path.is_file():
            parser.error(f"{path}: no such file (give a run's records.jsonl)")
    if (args.press is None) != (args.press_method is None):
        parser.error("--press and --press-method go together")
    press = (args.press, args.press_method) if args.press else None
    try:
        rows, notes = read_rows(args.base, args.trained, args.speed, args.base_speed, press)
    except UserError as err:
        parser.error(str(err))
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print("\n".join(report(rows)))
    if args.per_task:
        print("\n" + "\n".join(per_task(rows)))


if __name__ == "__main__":
    main()
