"""SPEED's RULER gap to full attention, as curves: against depth, against model size, against
training steps and against the distillation weight. It reads the per-sample records kept in
this folder (nothing is run) and pairs SPEED with full on the samples both answered, with the
leaderboard's margins (`speedkv measure paired-gaps` prints the same figures for one pair of
runs).

    .venv/bin/python benchmarks/training-recipe/curves.py \
        --plot benchmarks/training-recipe/curves.png

It prints one markdown table of every point and draws four panels. A point whose records are
not here yet (a run still going) is left out with a note on stderr.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from speedkv.leaderboard.paired_gaps import as_row, per_sample
from speedkv.leaderboard.rows import read_records
from speedkv.leaderboard.tables import difference

HERE = Path(__file__).resolve().parent


def speed(lcut: int, anchors: str, deep: int = 64) -> str:
    """A SPEED spec as the records spell it."""
    return f"speed:lcut={lcut},anchors={anchors},deep={deep},selfonly=false"


@dataclass(frozen=True)
class Point:
    """One gap: SPEED's row in `run` less full's row in `full_run` (the same run when None),
    on the samples both answered."""

    panel: str  # depth, size, steps or distill
    series: str  # one line of the panel
    x: float
    run: str  # folder under this one holding records.jsonl
    method: str
    full_run: str | None = None

    def gap(self) -> tuple[float, float] | None:
        """(gap, 95 % margin) in points, or None where a run's records are missing."""
        runs = [HERE / self.run, HERE / (self.full_run or self.run)]
        if not all((run / "records.jsonl").is_file() for run in runs):
            return None
        speed_scores = per_sample(read_records(runs[0] / "records.jsonl")[1], self.method)
        full_scores = per_sample(read_records(runs[1] / "records.jsonl")[1], "full")
        if not speed_scores or not full_scores:
            return None
        gap, margin, _ = difference(as_row(speed_scores), as_row(full_scores))
        return 100 * gap, 100 * margin


QWEN05_DEPTH = [
    Point(
        "depth",
        "Qwen2.5-0.5B, untrained, deep=64 (5 a task)",
        lcut / 24,
        "sizes-seed7/qwen05-depth",
        speed(lcut, "sink:4"),
    )
    for lcut in (12, 15, 18, 21)
]
# SmolLM2-135M on all 260 samples of seed 7 (deep=1): the shipped pydocs adapter (trained at
# lcut=22) run at three cuts in one run on one machine, and the untrained model at lcut=22
SMOL_DEPTH = [
    Point("depth", series, lcut / 30, f"smollm2-heldout-seed7/{run}", speed(lcut, "bos", 1), full)
    for series, run, full, cuts in (
        ("SmolLM2, untrained (20 a task)", "smol-held-base-speed", None, (22,)),
        ("SmolLM2 + pydocs adapter, vs its own full", "smol-held-r2", None, (22, 24, 26)),
        (
            "SmolLM2 + pydocs adapter, vs untrained full",
            "smol-held-r2",
            "smollm2-heldout-seed7/smol-held-base-full",
            (22, 24, 26),
        ),
    )
    for lcut in cuts
]
# Qwen2.5-Coder-0.5B on all 130 samples of seed 7 (deep=1): run 12's adapter (trained at
# lcut=18) at three cuts in one run, and the untrained model at the same cuts in another
QWEN05_TRAINED_DEPTH = [
    Point("depth", series, lcut / 24, f"qwen05-heldout-seed7/{run}", speed(lcut, "sink:4", 1), full)
    for series, run, full in (
        ("Qwen2.5-0.5B, untrained, deep=1 (10 a task)", "qwen-held-base10", None),
        ("Qwen2.5-0.5B + run 12's adapter, vs its own full", "qwen-held-r12", None),
        (
            "Qwen2.5-0.5B + run 12's adapter, vs untrained full",
            "qwen-held-r12",
            "qwen05-heldout-seed7/qwen-held-base10",
        ),
    )
    for lcut in (18, 20, 21)
]
SIZES = [
    Point(
        "size",
        "untrained, 75 % depth (seed 7, 5 a task)",
        0.135,
        "sizes-seed7/smol-held-base5",
        speed(22, "bos"),
    ),
    Point(
        "size",
        "untrained, 75 % depth (seed 7, 5 a task)",
        0.494,
        "sizes-seed7/qwen05-held-base",
        speed(18, "sink:4"),
    ),
    Point(
        "size",
        "untrained, 75 % depth (seed 7, 5 a task)",
        1.54,
        "sizes-seed7/qwen15-held-base",
        speed(21, "sink:4"),
    ),
    Point(
        "size",
        "trained (run 2's recipe), against untrained full (seed 7)",
        0.135,
        "smollm2-heldout-seed7/smol-held-r2",
        speed(22, "bos", 1),
        "smollm2-heldout-seed7/smol-held-base-full",
    ),
    Point(
        "size",
        "trained (run 2's recipe), against untrained full (seed 7)",
        0.494,
        "qwen05-heldout-seed7/qwen-held-r2",
        speed(18, "sink:4", 1),
        "qwen05-heldout-seed7/qwen-held-base10",
    ),
    Point(
        "size",
        "trained (run 2's recipe), against its own full (seed 7)",
        0.135,
        "smollm2-heldout-seed7/smol-held-r2",
        speed(22, "bos", 1),
    ),
    Point(
        "size",
        "trained (run 2's recipe), against its own full (seed 7)",
        0.494,
        "qwen05-heldout-seed7/qwen-held-r2",
        speed(18, "sink:4", 1),
    ),
]
# SmolLM2-135M, design seed 1 (5 a task): step 0 is the untrained model
STEPS = [
    Point("steps", series, steps, run, method, full)
    for series, method, runs in (
        (
            "run 1 (LoRA, deep=64), against untrained full",
            speed(22, "bos", 64),
            ((0, "smol-design-base"), (200, "smol-design-r1"), (300, "smol-design-r1-300")),
        ),
        (
            "run 2 (LoRA, deep=1), against untrained full",
            speed(22, "bos", 1),
            ((300, "smol-design-r2"),),
        ),
        (
            "run 5 (every weight, deep=1), against untrained full",
            speed(22, "bos", 1),
            ((200, "smol-design-r5-200"), (300, "smol-design-r5")),
        ),
        (
            "run 6 (LoRA, deep=1, stride=40), against untrained full",
            speed(22, "bos", 1) + ",stride=40",
            ((0, "smol-design-base-stride"), (300, "smol-design-r6")),
        ),
        (
            "run 7 (LoRA, deep=1, --keep-full 1), against untrained full",
            speed(22, "bos", 1),
            ((300, "smol-design-r7"),),
        ),
        (
            "run 10 (run 2 with a 600-step schedule), against untrained full",
            speed(22, "bos", 1),
            ((600, "smol-design-r10"),),
        ),
    )
    for steps, run in runs
    for run, full in [(f"smollm2-design-seed1/{run}", "smollm2-design-seed1/smol-design-base")]
]
# run 2's recipe at several weights of the KL term: SmolLM2-135M on design seed 1 (5 a task;
# runs 11 and 12 trained with bf16 autocast on an AVX512-BF16 CPU, run 2 in float32 on Zen 3),
# Qwen2.5-Coder-0.5B on the held-out seed 7 (10 a task, SPEED-18)
DISTILL = [
    Point("distill", f"{model}, {series}", weight, f"{folder}/{run}", spec, full)
    for model, folder, spec, base, runs in (
        (
            "SmolLM2, seed 1",
            "smollm2-design-seed1",
            speed(22, "bos", 1),
            "smol-design-base",
            ((0.0, "smol-design-r12"), (0.5, "smol-design-r2"), (1.0, "smol-design-r11")),
        ),
        (
            "Qwen2.5-0.5B, seed 7",
            "qwen05-heldout-seed7",
            speed(18, "sink:4", 1),
            "qwen-held-base10",
            ((0.0, "qwen-held-r12"), (0.5, "qwen-held-r2")),
        ),
    )
    for weight, run in runs
    for series, full in (
        ("against untrained full", f"{folder}/{base}"),
        ("against its own full", None),
    )
]
PANELS = {
    "depth": ("layers below the cut (lcut / layers; seed 7)", "SPEED - full, RULER points"),
    "size": ("parameters (billions)", "SPEED - full, RULER points"),
    "steps": ("training steps (SmolLM2-135M, design seed 1)", "SPEED - untrained full"),
    "distill": ("--distill weight (300 steps)", "SPEED - full"),
}


def measured(points: list[Point]) -> list[tuple[Point, float, float]]:
    """Each point with its gap and margin; the missing ones named on stderr."""
    out = []
    for point in points:
        value = point.gap()
        if value is None:
            print(f"note: {point.run} has no records of {point.method} yet", file=sys.stderr)
        else:
            out.append((point, *value))
    return out


def table(rows: list[tuple[Point, float, float]]) -> str:
    lines = ["| panel | series | x | SPEED - full | records |", "|---|---|---:|---:|---|"]
    for point, gap, margin in rows:
        lines.append(
            f"| {point.panel} | {point.series} | {point.x:g} | {gap:+.1f} ± {margin:.1f} "
            f"| `{point.run}` |"
        )
    return "\n".join(lines)


def plot(rows: list[tuple[Point, float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8.4))
    for ax, (panel, (xlabel, ylabel)) in zip(axes.flat, PANELS.items(), strict=True):
        mine = [r for r in rows if r[0].panel == panel]
        for series in dict.fromkeys(p.series for p, _, _ in mine):
            points = sorted((p.x, g, m) for p, g, m in mine if p.series == series)
            xs, gaps, margins = zip(*points, strict=True)
            ax.errorbar(xs, gaps, yerr=margins, marker="o", capsize=3, label=series)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.axhline(-2, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if panel == "size":
            ax.set_xscale("log")
            ax.set_xticks([0.135, 0.5, 1.5], ["135M", "0.5B", "1.5B"])
            ax.minorticks_off()
        if mine:
            ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("SPEED's RULER gap to full attention, 4K, bfloat16 (dashed: the -2 target)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot", type=Path, help="write the panels to this PNG")
    args = parser.parse_args(argv)
    rows = measured(QWEN05_DEPTH + QWEN05_TRAINED_DEPTH + SMOL_DEPTH + SIZES + STEPS + DISTILL)
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
