"""benchmarks/peers.py's arithmetic: the limit rows (the machine's bound on each method) and
batch rates from median wall times, rendered into the table users read."""

from __future__ import annotations

import pytest

from speedkv.bench.roofline import MachineLimits

from helpers import load_benchmark


@pytest.fixture(scope="module")
def peers():
    return load_benchmark("peers")


def measured(peers, engine, method, n, repeat, ttft, tpot, kv=1000, flops=10**9):
    return peers.row(engine, method, n, repeat, ttft, tpot, [1, 2]) | {
        "kv_bytes": kv, "kv_bytes_final": kv + 200, "flops_prefill": flops
    }  # fmt: skip


class Args:
    batch_new_tokens = 5


def test_limit_rows_bound_each_method_by_the_measured_rates(peers):
    limits = MachineLimits(bandwidth_bytes_s=1e9, matmul_flops_s=1e12, dtype="bfloat16",
                           device="cpu", gemv_bytes_s=5e8)  # fmt: skip
    rows = [
        measured(peers, "speedkv prepacked", "full", 2048, 0, 1.0, 0.01, kv=1000, flops=4e11),
        measured(peers, "speedkv prepacked", "full", 2048, 1, 1.1, 0.01),  # only repeat 0 counts
        measured(peers, "speedkv plain", "full", 2048, 0, 1.0, 0.02),  # same work as prepacked
        peers.batch_row("speedkv prepacked", 8, 0, 2.0, 3.0, Args),  # batches have no limit row
    ]
    (bound,) = peers.limit_rows(rows, limits, weight_bytes=10**6)
    assert bound["kind"] == "limit" and bound["method"] == "full" and bound["length"] == 2048
    assert bound["ttft_s"] == pytest.approx(4e11 / 1e12)
    # the weights at the one-row product rate, the mean of the first and last K/V at bandwidth
    assert bound["tpot_s"] == pytest.approx(1e6 / 5e8 + 1100 / 1e9)


def test_batch_rates_come_from_the_median_wall_times(peers):
    class Args:
        batch_new_tokens = 11

    runs = [peers.batch_row("x", 4, r, t1, tn, Args) for r, (t1, tn) in
            enumerate([(10.0, 12.0), (11.0, 12.5), (30.0, 31.0)])]  # fmt: skip
    decode, e2e = peers.batch_rates(runs)
    assert decode == pytest.approx(4 * 10 / (12.5 - 11.0))
    assert e2e == pytest.approx(4 * 11 / 12.5)


def test_the_table_shows_every_engine_the_limit_and_the_rates(peers):
    class Args:
        batch_new_tokens = 5

    rows = [
        measured(peers, "speedkv plain", "full", 2048, 0, 1.0, 0.020),
        measured(peers, "speedkv prepacked", "full", 2048, 0, 0.9, 0.010),
        peers.row("OpenVINO GenAI 2026.4.1 bf16", "full", 2048, "median", 0.5, 0.012, [1, 2]),
        peers.row(peers.LIMIT, "full", 2048, "bound", 0.25, 0.004, []) | {"kind": "limit"},
        peers.batch_row("speedkv prepacked", 8, 0, 2.0, 3.0, Args),
    ]
    limits = {"bandwidth_bytes_s": 3e10, "matmul_flops_s": 4e11, "dtype": "bfloat16",
              "gemv_bytes_s": 2.5e10, "decode_weight_bytes": 257 * 2**20}  # fmt: skip
    text = peers.tables(rows, [2048], limits)
    assert "30.0 GB/s read, 0.400 TFLOP/s bfloat16 matmul, 25.0 GB/s" in text
    assert "| OpenVINO GenAI 2026.4.1 bf16 | `full` | 0.50 | 12.0 | 1/1 |" in text
    assert f"| *{peers.LIMIT}* | `full` | 0.25 | 4.0 |" in text
    assert "| speedkv prepacked | 32.0 | 13.3 |" in text  # 8 * 4 / (3 - 2), 8 * 5 / 3


def test_kernel_paths_table_takes_medians_and_names_a_revision_that_fails():
    """`speedkv measure kernel-paths-ab`: medians over rounds per (revision, setting); a revision
    that cannot run a setting on this machine gets a row that says why, not a crash."""
    from speedkv.bench.measure import kernel_paths_ab as ab

    figures = [{f"{m} 64": {"ttft_s": t, "tpot_ms": 10 * t} for m in ab.METHODS} for t in (1, 3, 2)]
    rows = [{"code": "this tree", "setting": "auto", "figures": f} for f in figures] + [
        {"code": "before (abc)", "setting": "auto", "figures": {"error": "RuntimeError: no bf16"}}
    ]
    text = ab.table(rows, [64])
    assert "| this tree | auto | 3 | 2.00 | 20.0 | 2.00 | 20.0 |" in text
    assert "| before (abc) | auto | 0 | fails: RuntimeError: no bf16 |" in text
