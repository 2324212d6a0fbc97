"""benchmarks/gpu.py, the GPU check, runs here at a tiny shape on the CPU, so the command a GPU
machine gets cannot rot: the reference tests pass through it, every efficiency run completes,
SPEED's KV bytes are exactly its layer limit (alone and in batches), the decode attention
kernels agree, the profile names operators, and the results print as the docs' table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_tiny_on_the_cpu(tmp_path):
    # as docs/gpu.md runs it (PYTHONPATH=src: a GPU machine has no speedkv installed); a
    # caller's pytest options (here a plugin that does not exist) are not the check's
    env = {**os.environ, "PYTHONPATH": "src", "PYTEST_ADDOPTS": "-p no_such_plugin"}
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--tiny", "--device", "cpu", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    exact = json.loads((tmp_path / "exactness.json").read_text())["exactness"]
    assert exact["failed"] == 0 and exact["passed"] > 300, exact
    result = json.loads((tmp_path / "efficiency.json").read_text())
    runs = result["runs"]
    speed = "speed:lcut=3,anchors=bos,deep=1"
    variants = [m + v for v in ("", "+eager", "+matmul", "+chunk1024") for m in ("full", speed)]
    assert {r["method"] for r in runs} == {*variants, "hf"}
    assert all(r["status"] == "ok" for r in runs)
    for r in runs:
        if r["method"].startswith("speed"):  # anchor + last prompt token in each upper layer
            limit = result["layer_limits"][str(r["length"])]["kv"]
            assert abs(r["kv_ratio"] - limit) < 1e-12
        assert r["ttft_s"] > 0 and r["tpot_s"] > 0
    batched = json.loads((tmp_path / "batch.json").read_text())["runs"]
    assert {(r["batch"], r["length"]) for r in batched} == {(2, 64), (2, 128), (4, 64), (4, 128)}
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in batched)
    for r in batched:  # every sequence of the batch holds exactly SPEED's layer limit
        if r["method"].startswith("speed"):
            limit = result["layer_limits"][str(r["length"])]["kv"]
            assert abs(r["kv_bytes_ratio"] - limit) < 1e-12
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert profile["full"]["decode"]["top"] and profile["full"]["prefill"]["top"]
    assert profile["full"]["decode"]["host_top"]
    step = profile["full"]["decode_step_ms"]
    assert 0 < step["host"] <= step["wall"]
    kernels = json.loads((tmp_path / "attention.json").read_text())["decode_attention"]
    engine = [r for r in kernels if r["kernel"] == "the engine's"]
    assert len(engine) == 2 and all(r["max_abs_diff"] < 1e-2 and r["us"] > 0 for r in engine)
    table = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--table", str(tmp_path / "efficiency.json")],
        capture_output=True, text=True, check=True, env=env, cwd=ROOT,
    ).stdout  # fmt: skip
    assert table.count("| `full` |") == 2 and "transformers `generate`" in table
    batch_table = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--table", str(tmp_path / "batch.json")],
        capture_output=True, text=True, check=True, env=env, cwd=ROOT,
    ).stdout  # fmt: skip
    assert batch_table.count("| `full` |") == 4 and "| 4 | `speed:lcut=3" in batch_table


def test_without_speedkv_on_the_path_the_check_says_how_to_run_it(tmp_path):
    """A GPU machine has torch and transformers but no speedkv installed: started without
    PYTHONPATH=src, the check says the command to run, not a traceback."""
    # this environment's packages without the files that install speedkv (-S: no .pth files)
    site = sysconfig.get_paths()["purelib"]
    code = ("import runpy, sys; sys.path.append(sys.argv[1]); sys.argv = sys.argv[2:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-S", "-c", code, site, str(ROOT / "benchmarks" / "gpu.py"), "--help"],
        capture_output=True, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert "PYTHONPATH=src python3 benchmarks/gpu.py" in done.stderr


def test_the_table_reads_an_earlier_runs_variants():
    """docs/gpu.md quotes the H200 run's `+chunk8192` rows (8192-row chunks, now the GPU's
    default): its file still prints with each row's bound against full's run the same way."""
    recorded = ROOT / "benchmarks/gpu/h200/4-flash-batches/run1/efficiency.json"
    table = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--table", str(recorded)],
        capture_output=True, text=True, check=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    ).stdout  # fmt: skip
    assert "| 128K | `full+chunk8192` | 11.95 |" in table and "6.40 (1.87x)" in table
    speed = next(line for line in table.splitlines() if "deep=1+chunk8192` | 8.98" in line)
    assert "| 0.751 |" in speed  # TTFT against full+chunk8192, not against the default full
