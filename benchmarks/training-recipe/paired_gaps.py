"""RULER averages and paired gaps between two `speedkv eval --tasks ruler` runs on the same
samples (same seed and length), with the leaderboard's margins (Student's t below 10 samples a
task).

    .venv/bin/python benchmarks/training-recipe/paired_gaps.py \
        BASE_DIR/records.jsonl TRAINED_DIR/records.jsonl --speed speed:lcut=22,...

BASE is the untrained model's run, TRAINED the adapter's; each holds `full` and one SPEED spec.
"""

from __future__ import annotations

import argparse
import json
import statistics

from speedkv.evals import ruler
from speedkv.leaderboard.rows import Row
from speedkv.leaderboard.tables import difference


def per_sample(path: str, method: str) -> dict[tuple[str, int], float]:
    scores = {}
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            record = json.loads(line)
            if record.get("method") == method:
                scores[(record["task"], record["sample"])] = record["score"]
    return scores


def as_row(scores: dict[tuple[str, int], float]) -> Row:
    by_task = {t: [v for (task, _), v in scores.items() if task == t] for t in ruler.TASKS}
    return Row(
        method="",
        engine="speedkv",
        adapter=None,
        setting="aware",
        length=0,
        scores={t: statistics.fmean(v) for t, v in by_task.items()},
        counts={t: len(v) for t, v in by_task.items()},
        kv_ratio=1.0,
        ttft_ratio=None,
        extra={"per_sample": scores},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base")
    parser.add_argument("trained")
    parser.add_argument("--speed", required=True, help="the SPEED spec as the records spell it")
    parser.add_argument("--base-speed", help="BASE's SPEED spec, where it differs from --speed")
    args = parser.parse_args()
    found = {
        "untrained full": per_sample(args.base, "full"),
        "untrained SPEED": per_sample(args.base, args.base_speed or args.speed),
        "trained full": per_sample(args.trained, "full"),
        "trained SPEED": per_sample(args.trained, args.speed),
    }
    rows = {name: as_row(scores) for name, scores in found.items() if scores}  # rows run
    for name, row in rows.items():
        print(f"{name}: {100 * row.average:.1f} ± {100 * row.margin:.1f}")
    for a, b in (
        ("trained SPEED", "untrained full"),
        ("trained SPEED", "trained full"),
        ("trained SPEED", "untrained SPEED"),
        ("trained full", "untrained full"),
    ):
        if a not in rows or b not in rows:
            continue
        gap, margin, paired = difference(rows[a], rows[b])
        print(f"{a} - {b}: {100 * gap:+.1f} ± {100 * margin:.1f}{' (paired)' if paired else ''}")


if __name__ == "__main__":
    main()
