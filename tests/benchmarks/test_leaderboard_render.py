"""`speedkv leaderboard render` redraws a published board from what the repository archives
beside it, nothing else: no runs, no kvpress environment, no RULER samples."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from speedkv.leaderboard.served import served_page

from helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"
BOARD = "qwen2.5-coder-0.5b-16384"  # the smallest board, paired with kvpress's answers


def dated(page: str) -> str:
    """A board without the minute it was drawn."""
    return re.sub(r"^Generated \S+ \S+ by", "Generated DATE by", page, count=1, flags=re.M)


def test_render_redraws_a_board_from_its_archived_answers_alone(tmp_path, monkeypatch, capsys):
    board = tmp_path / "benchmarks" / "ruler" / BOARD
    shutil.copytree(ROOT / "benchmarks" / "ruler" / BOARD / "answers", board / "answers")
    shutil.copy(ROOT / "benchmarks" / "ruler" / BOARD / "results.json", board / "results.json")
    monkeypatch.chdir(tmp_path)  # boards and runs are found from the current directory
    code, out, err = run_cli(
        ["leaderboard", "render", "--model", "qwen2.5-coder-0.5b", "--length", "16384",
         "--kvpress-python", str(tmp_path / "no-kvpress-here")],
        monkeypatch, capsys,
    )  # fmt: skip
    assert code == 0, err
    assert "could not be rewritten" not in err  # kvpress's records came from the archive
    # the published figures, byte for byte
    published = ROOT / "benchmarks" / "ruler" / BOARD / "results.json"
    assert (board / "results.json").read_bytes() == published.read_bytes()
    # the page byte for byte as the code drew it before it moved into the package (dates
    # aside), kvpress's rows paired with speedkv's on the samples both answered
    page = (board / "leaderboard.md").read_text()
    assert dated(page) == (DATA / f"{BOARD}.leaderboard.md").read_text()
    assert "within the margins (paired)" in page
    assert (board / "pareto.png").is_file()


def test_the_served_board_is_its_results_drawn_again():
    served = ROOT / "benchmarks" / "ruler-served"
    result = json.loads((served / "results.json").read_text())
    assert served_page(result) == (served / "table.md").read_text()


def test_render_names_one_board_with_both_model_and_length(monkeypatch, capsys):
    code, _, err = run_cli(
        ["leaderboard", "render", "--model", "smollm2-135m"], monkeypatch, capsys
    )
    assert code == 2
    assert "both --model and --length" in err


def test_the_group_alone_lists_its_commands(monkeypatch, capsys):
    code, out, _ = run_cli(["leaderboard"], monkeypatch, capsys)
    assert code == 0
    assert "run" in out and "render" in out
