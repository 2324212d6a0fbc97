"""The upper layers hold blocks for their full-depth rows only: read from vLLM's own KV
manager, and visible as more requests running at once in a fixed pool
(benchmarks/vllm_capacity.py, run small)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPT = 360  # 3 blocks of 128 with the 8 new tokens: no request grows while decoding
POOL = 9  # stock blocks: a pool that runs 2 of the 6 requests at once


def test_speed15_fits_twice_the_requests_of_stock(tmp_path):
    out = tmp_path / "capacity.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "vllm_capacity.py"),
         "--methods", "full;speed:lcut=15,anchors=bos,deep=1", "--prompt-tokens", str(PROMPT),
         "--requests", "6", "--new-tokens", "8", "--pool-stock-blocks", str(POOL),
         "--out", str(out)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    runs = {(r["method"], r["compact_kv"]): r for r in json.loads(out.read_text())["runs"]}
    stock = runs[("full", None)]
    compact = runs[("speed:lcut=15,anchors=bos,deep=1", True)]
    uncompacted = runs[("speed:lcut=15,anchors=bos,deep=1", False)]
    prompt_blocks = math.ceil((PROMPT + 8) / 128)
    # one group of 30 layers in stock vLLM; 15 lower + 15 upper layers under SPEED-15
    assert [g["layers"] for g in stock["groups"]] == [30]
    assert [(g["layers"], g["spec"]) for g in compact["groups"]] == [
        (15, "FullAttentionSpec"), (15, "SpeedUpperSpec")]  # fmt: skip
    assert stock["decode_blocks_per_group"] == [prompt_blocks]
    assert compact["decode_blocks_per_group"] == [prompt_blocks, 1]
    # the same bytes: 9 blocks of 30 layers, or 18 of 15 (vLLM keeps one empty); a request
    # takes 3, or 3 + 1 of half the size: 2 requests at once, or 4 (of the 6)
    assert compact["num_blocks"] == 2 * stock["num_blocks"] == 2 * POOL
    assert stock["max_running"] == uncompacted["max_running"] == (POOL - 1) // prompt_blocks
    assert compact["max_running"] == (2 * POOL - 1) // (prompt_blocks + 1)
    assert compact["max_running"] >= 1.8 * stock["max_running"]
    assert compact["preemptions"] == 0 == stock["preemptions"]
    assert compact["tokens"] == uncompacted["tokens"]
