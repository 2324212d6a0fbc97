"""`speedkv measure NAME [ARGS]...`: every registered measurement imports and has a `main`,
the listing names them all, an unknown name is one sentence and exit 2, and everything after
NAME reaches the measurement's own argparse options. No model loads."""

from __future__ import annotations

import importlib
import sys

import pytest
from typer.testing import CliRunner

from speedkv.bench.measure import MEASUREMENTS, summary
from speedkv.cli import app as cli


@pytest.mark.parametrize("name", sorted(MEASUREMENTS))
def test_every_measurement_imports_and_has_a_main(name):
    module = importlib.import_module(MEASUREMENTS[name])
    assert callable(module.main)
    # one line, read from the file: what the listing shows
    assert summary(name) and "\n" not in summary(name)


@pytest.mark.parametrize("words", [["measure", "--help"], ["measure"]])
def test_the_listing_names_every_measurement(words):
    done = CliRunner().invoke(cli.app, words)
    assert done.exit_code == 0, done.output
    for name in MEASUREMENTS:
        assert f"  {name}  " in done.output
    assert "speedkv measure NAME --help" in done.output


def test_an_unknown_name_is_one_sentence_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["speedkv", "measure", "nosuch"])
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: no measurement named 'nosuch'")
    assert all(name in line for name in MEASUREMENTS)


def test_help_after_the_name_is_the_measurements_own():
    done = CliRunner().invoke(cli.app, ["measure", "prefill-chunks", "--help"])
    assert done.exit_code == 0, done.output
    assert done.output.startswith("usage: speedkv measure prefill-chunks")
    assert "--chunks CHUNKS" in done.output


def test_every_word_after_the_name_is_passed_on(monkeypatch):
    seen = []
    monkeypatch.setattr("speedkv.cli.measure.load_main", lambda name: seen.append)
    words = ["--methods", "full;speed", "-h", "--json", "--", "x"]
    done = CliRunner().invoke(cli.app, ["measure", "loadtest", *words])
    assert done.exit_code == 0, done.output
    # click drops the `--` that ends its own options; the rest arrive as typed
    assert seen == [["--methods", "full;speed", "-h", "--json", "x"]]
