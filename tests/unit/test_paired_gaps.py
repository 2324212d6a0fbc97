"""`speedkv measure paired-gaps`: RULER averages and paired gaps between two runs' records,
checked on a tiny pair of records.jsonl written here, with margins worked out by hand.

Ten samples a task, so every margin takes the normal's 1.96 (Student's t only below ten).
Untrained full and trained SPEED answer samples 0-4 of every task right (0.5 a task), trained
full answers 0-5 (0.6). Their margins: 1.96 * sqrt(13 * 0.25 / 10) / 13 = 8.6 points and
1.96 * sqrt(13 * 0.24 / 10) / 13 = 8.4. Trained full less untrained full differs on sample 5
alone, a difference of 0.1 a task whose mean varies by var([1, 0 x 9]) / 10 = 0.01: 1.96 *
sqrt(13 * 0.01) / 13 = 5.4 points, where the two rows' own margins combined would give 12.0.
Trained SPEED and untrained full agree on every sample: +0.0 ± 0.0. The untrained run holds
`full` alone, so there is no untrained SPEED row."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from speedkv.bench.measure import MEASUREMENTS
from speedkv.cli import app as cli
from speedkv.evals import ruler
from speedkv.leaderboard import paired_gaps
from speedkv.leaderboard.tables import difference

SPEED = "speed:lcut=22,anchors=bos,deep=1,selfonly=false"


def write_run(path: Path, rights: dict[str, int], tasks=ruler.TASKS) -> Path:
    """A records.jsonl of ten samples a task for each method; samples below `rights[method]`
    score 1, the rest 0. A header first and a line cut short last, as a killed run leaves."""
    lines = [json.dumps({"header": {"model": "tiny", "seed": 7}})]
    for method, right in rights.items():
        for task in tasks:
            for sample in range(10):
                score = 1.0 if sample < right else 0.0
                lines.append(json.dumps({"method": method, "task": task, "length": 4096,
                                         "sample": sample, "score": score}))  # fmt: skip
    path.write_text("\n".join(lines) + '\n{"method": "full", "ta')
    return path


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path]:
    base = write_run(tmp_path / "base.jsonl", {"full": 5})
    trained = write_run(tmp_path / "trained.jsonl", {"full": 6, SPEED: 5})
    return base, trained


EXPECTED = [
    "untrained full: 50.0 ± 8.6",
    "trained full: 60.0 ± 8.4",
    "trained SPEED: 50.0 ± 8.6",
    "trained SPEED - untrained full: +0.0 ± 0.0 (paired)",
    "trained SPEED - trained full: -10.0 ± 5.4 (paired)",
    "trained full - untrained full: +10.0 ± 5.4 (paired)",
]


def test_it_is_registered_in_the_leaderboard_layer():
    assert MEASUREMENTS["paired-gaps"] == "speedkv.leaderboard.paired_gaps"


def test_the_gaps_are_paired_with_the_margins_worked_out_by_hand(runs):
    rows, notes = paired_gaps.read_rows(*runs, SPEED)
    assert list(rows) == ["untrained full", "trained full", "trained SPEED"]
    assert rows["trained full"].average == pytest.approx(0.6)
    assert rows["trained full"].margin == pytest.approx(1.96 * math.sqrt(13 * 0.024) / 13)
    gap, margin, paired = difference(rows["trained full"], rows["untrained full"])
    assert paired and gap == pytest.approx(0.1)
    assert margin == pytest.approx(1.96 * math.sqrt(13 * 0.01) / 13)
    assert difference(rows["trained SPEED"], rows["untrained full"]) == (0.0, 0.0, True)
    assert paired_gaps.report(rows) == EXPECTED
    # the absent row is named, with what the run does hold
    (note,) = notes
    assert note.startswith(f"untrained SPEED left out: {runs[0]} holds no RULER records of ")
    assert note.endswith("(its methods: full)")


def test_the_command_prints_the_rows_and_gaps(runs):
    base, trained = runs
    done = CliRunner().invoke(
        cli.app, ["measure", "paired-gaps", str(base), str(trained), "--speed", SPEED]
    )
    assert done.exit_code == 0, done.output
    assert done.stdout.splitlines() == EXPECTED
    assert done.stderr.startswith("note: untrained SPEED left out")


def test_base_speed_names_the_untrained_runs_own_spec(tmp_path):
    base = write_run(tmp_path / "base.jsonl", {"full": 5, "speed:deep=64": 2})
    trained = write_run(tmp_path / "trained.jsonl", {"full": 6, SPEED: 5})
    rows, notes = paired_gaps.read_rows(base, trained, SPEED, base_speed="speed:deep=64")
    assert notes == []
    lines = paired_gaps.report(rows)
    assert "untrained SPEED: 20.0 ± 6.9" in lines  # 1.96 * sqrt(13 * 0.16 / 10) / 13
    # samples 2-4 of each task differ by 1: mean 0.3, var([1 x 3, 0 x 7]) / 10 = 0.0233 / 10
    assert "trained SPEED - untrained SPEED: +30.0 ± 8.3 (paired)" in lines


def test_a_row_short_of_a_task_is_incomplete_and_has_no_gaps(tmp_path):
    base = write_run(tmp_path / "base.jsonl", {"full": 5})
    trained = write_run(tmp_path / "trained.jsonl", {"full": 6})
    write_run(tmp_path / "speed.jsonl", {SPEED: 5}, tasks=ruler.TASKS[:-1])
    with trained.open("a") as out:  # append the SPEED records, less qa_2, after the cut line
        out.write("\n" + (tmp_path / "speed.jsonl").read_text())
    rows, _ = paired_gaps.read_rows(base, trained, SPEED)
    lines = paired_gaps.report(rows)
    assert "trained SPEED: incomplete (12 of 13 tasks answered)" in lines
    assert not any(line.startswith("trained SPEED -") for line in lines)
    assert "trained full - untrained full: +10.0 ± 5.4 (paired)" in lines


def test_a_missing_file_is_one_sentence_and_exit_2(runs, tmp_path, monkeypatch, capsys):
    missing = tmp_path / "nosuch" / "records.jsonl"
    monkeypatch.setattr(
        sys, "argv", ["speedkv", "measure", "paired-gaps", str(runs[0]), str(missing),
                      "--speed", SPEED]
    )  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {missing}: no such file (give a run's records.jsonl)" in err


def test_no_row_at_all_is_an_error_naming_what_the_runs_hold(tmp_path, capsys):
    empty = tmp_path / "records.jsonl"
    empty.write_text('{"header": {}}\n')
    with pytest.raises(SystemExit) as stop:
        paired_gaps.main([str(empty), str(empty), "--speed", SPEED])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"neither run holds RULER records of 'full' or '{SPEED}'; {empty} holds: none" in err


def test_help_names_the_command_and_its_options():
    done = CliRunner().invoke(cli.app, ["measure", "paired-gaps", "--help"])
    assert done.exit_code == 0, done.output
    assert done.output.startswith("usage: speedkv measure paired-gaps")
    assert "--speed SPEED" in done.output and "--base-speed BASE_SPEED" in done.output


def test_one_run_alone_gives_speeds_gap_to_its_own_full(tmp_path: Path):
    """Without a trained run: the untrained rows and SPEED's paired gap to full (the trained
    run's full row above, here as one run holding both)."""
    run = write_run(tmp_path / "one.jsonl", {"full": 6, SPEED: 5})
    rows, notes = paired_gaps.read_rows(run, None, SPEED)
    assert notes == [] and set(rows) == {"untrained full", "untrained SPEED"}
    assert paired_gaps.report(rows) == [
        "untrained full: 60.0 ± 8.4",
        "untrained SPEED: 50.0 ± 8.6",
        "untrained SPEED - untrained full: -10.0 ± 5.4 (paired)",
    ]


def test_per_task_lists_every_task_and_names_the_largest_loss(tmp_path: Path):
    """Each task's score in points and SPEED's paired per-task gaps; one task where SPEED
    answers nothing is named as the largest loss against untrained full."""
    base = write_run(tmp_path / "base.jsonl", {"full": 5})
    trained = write_run(tmp_path / "trained.jsonl", {"full": 6, SPEED: 5})
    records = trained.read_text().splitlines()
    cwe = json.dumps({"method": SPEED, "task": "ruler/cwe", "length": 4096, "sample": 0,
                      "score": 0.0})  # fmt: skip
    trained.write_text("\n".join(records[:-1] + [cwe]) + "\n")  # sample 0 of cwe, its latest
    rows, _ = paired_gaps.read_rows(base, trained, SPEED)
    lines = paired_gaps.per_task(rows)
    assert lines[0] == (
        "| task | untrained full | trained full | trained SPEED | SPEED - untrained full "
        "| SPEED - its own full |"
    )
    assert len(lines) == 2 + len(ruler.TASKS) + 1
    assert "| niah_single_1 | 50.0 | 60.0 | 50.0 | +0.0 | -10.0 |" in lines
    assert "| cwe | 50.0 | 60.0 | 40.0 | -10.0 | -20.0 |" in lines
    assert lines[-1] == "largest per-task loss of trained SPEED against untrained full: cwe -10.0"


def test_per_task_of_one_run_gives_speeds_gap_to_its_full(tmp_path: Path):
    run = write_run(tmp_path / "one.jsonl", {"full": 6, SPEED: 5})
    lines = paired_gaps.per_task(paired_gaps.read_rows(run, None, SPEED)[0])
    assert lines[0] == "| task | untrained full | untrained SPEED | SPEED - full |"
    assert "| qa_2 | 60.0 | 50.0 | -10.0 |" in lines
    assert lines[-1].endswith("niah_single_1 -10.0")  # ties: the first task in RULER's order


def test_the_per_task_flag_prints_the_table_after_the_gaps(runs, capsys):
    paired_gaps.main([str(runs[0]), str(runs[1]), "--speed", SPEED, "--per-task"])
    out = capsys.readouterr().out.splitlines()
    assert out[: len(EXPECTED)] == EXPECTED and out[len(EXPECTED)] == ""
    assert out[len(EXPECTED) + 1].startswith("| task | untrained full |")


def test_a_press_on_the_same_samples_gets_its_row_and_speeds_paired_gap(runs, tmp_path):
    """A press's records (kvpress on the same weights) answer samples 0-3 of each task right:
    SPEED (0-4) beats it on sample 4 alone, +10.0 with the paired margin 5.4 as above."""
    press = write_run(tmp_path / "press.jsonl", {"kvpress:tova,ratio=0.267": 4})
    rows, _ = paired_gaps.read_rows(*runs, SPEED, press=(press, "kvpress:tova,ratio=0.267"))
    lines = paired_gaps.report(rows)
    assert "press: 40.0 ± 8.4" in lines  # 1.96 * sqrt(13 * 0.24 / 10) / 13
    assert "trained SPEED - press: +10.0 ± 5.4 (paired)" in lines


def test_press_and_press_method_go_together(runs, capsys):
    with pytest.raises(SystemExit) as stop:
        paired_gaps.main([str(runs[0]), "--speed", SPEED, "--press", str(runs[1])])
    assert stop.value.code == 2
    assert "--press and --press-method go together" in capsys.readouterr().err
