"""How often a model's answer to RULER's common-word task (`cwe`, "the 10 most common words")
repeats itself instead of naming ten words. It reads per-sample records (nothing is run) and
prints, per run and method: the task's score, the mean number of distinct words among each
answer's first 30 words, and how many answers name one word 6 times or more in those 30.

    .venv/bin/python benchmarks/training-recipe/repeats.py \
        benchmarks/training-recipe/qwen05-heldout-seed7/qwen-held-base10 \
        benchmarks/training-recipe/qwen05-heldout-seed7/qwen-held-r2
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

from speedkv.leaderboard.rows import read_run

FIRST_WORDS = 30
LOOP_COUNT = 6
WORD = re.compile(r"[a-z][a-z-]+")


def answer_words(answer: str) -> list[str]:
    """The answer's first words, lowercased (list numbers and punctuation dropped)."""
    return WORD.findall(answer.lower())[:FIRST_WORDS]


def summarise(records: list[dict], task: str) -> dict[str, tuple[int, float, float, int]]:
    """Per method: samples, mean score (percent), mean distinct words, answers in a loop."""
    by_method: dict[str, list[dict]] = {}
    for record in records:
        if record["task"] == task:
            by_method.setdefault(record["method"], []).append(record)
    rows = {}
    for method, found in by_method.items():
        words = [answer_words(r["answer"]) for r in found]
        distinct = sum(len(set(w)) for w in words) / len(found)
        loops = sum(1 for w in words if w and Counter(w).most_common(1)[0][1] >= LOOP_COUNT)
        score = 100 * sum(float(r["score"]) for r in found) / len(found)
        rows[method] = (len(found), score, distinct, loops)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders holding records.jsonl")
    parser.add_argument("--task", default="ruler/cwe", help="the RULER task to read")
    args = parser.parse_args()
    print(
        f"| run | method | samples | score | distinct words of the first {FIRST_WORDS} | "
        f"answers with one word {LOOP_COUNT}+ times |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for run in args.runs:
        _, records = read_run(run)
        for method, (n, score, distinct, loops) in summarise(records, args.task).items():
            print(f"| {run.name} | `{method}` | {n} | {score:.1f} | {distinct:.1f} | {loops} |")


if __name__ == "__main__":
    main()
