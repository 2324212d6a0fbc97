"""benchmarks/training-recipe/repeats.py: an answer that names one word again and again counts
as a loop, a list of distinct words does not, and the published table reads the kept answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from speedkv.leaderboard.rows import read_run

from helpers import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def repeats():
    return load_script("benchmarks/training-recipe", "repeats")


def test_loops_and_distinct_words_are_counted_per_method(repeats):
    looped = {"task": "ruler/cwe", "method": "speed", "score": "0.1", "answer": "3. edge, " * 40}
    listed = {"task": "ruler/cwe", "method": "full", "score": "0.9",
              "answer": "1. lime 2. blind 3. wind-chime 4. vertigo 5. flume"}  # fmt: skip
    other = {"task": "ruler/vt", "method": "full", "score": "1.0", "answer": "x x x x x x x"}
    rows = repeats.summarise([looped, listed, other], "ruler/cwe")
    assert rows["speed"] == (1, 10.0, 1.0, 1)
    assert rows["full"] == (1, 90.0, 5.0, 0)


def test_the_published_qwen_rows_come_from_the_kept_answers(repeats):
    _, records = read_run(ROOT / "benchmarks/training-recipe/qwen05-heldout-seed7/qwen-held-base10")
    rows = repeats.summarise(records, "ruler/cwe")
    full = rows["full"]
    speed = rows["speed:lcut=18,anchors=sink:4,deep=1,selfonly=false"]
    assert full[0] == speed[0] == 10 and full[3] == 0 and speed[3] == 10
    assert round(full[1]) == 70 and round(speed[1]) == 5
