"""The RULER leaderboard's plans: every row a valid spec, peers at SPEED's KV ratio, the shipped
adapters present, and the commands each sweep would run."""

from __future__ import annotations

from pathlib import Path

import pytest

from speedkv.core.registry import parse_spec

from helpers import load_benchmark

board = load_benchmark("ruler_leaderboard")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("key", list(board.PLANS), ids=lambda k: f"{k[0]}-{k[1]}")
def test_every_plan_names_valid_rows_and_a_shipped_adapter(key):
    plan = board.PLANS[key]
    sweeps = board.sweeps(plan)
    for sweep in sweeps.values():
        if not sweep.peer:
            for method in sweep.methods:
                parse_spec(method)  # raises on a bad spec
    assert (ROOT / plan.adapter / "adapter_model.safetensors").is_file()
    assert 0 < plan.kv < 1 and plan.samples >= 1
    # SPEED's rows spell their deep suffix: the leaderboard must not move with the default
    assert all("deep=" in spec for spec in plan.speed)
    assert ("agnostic" in sweeps) == bool(plan.agnostic)


def test_the_4k_board_runs_every_method_at_speed22s_kv_ratio(tmp_path):
    plan = board.PLANS[("smollm2-135m", 4096)]
    names = {parse_spec(m).name for m in board.sweeps(plan)["base"].methods}
    assert names == {
        "full", "speed", "snapkv", "streamingllm", "pop", "swiftkv", "fastkv", "specprefill",
        "gemfilter", "h2o", "pyramidinfer",
    }  # fmt: skip
    assert f"retain={plan.kv}" in board.sweeps(plan)["base"].methods[4]
    command = board.eval_command(
        "smollm2-135m", 4096, plan.samples, board.sweeps(plan)["adapter"], ["ruler/vt"], tmp_path
    )
    assert command[command.index("--samples") + 1] == "ruler=20"
    assert command[-2:] == ["--adapter", plan.adapter]


def test_kvpress_runs_at_every_kv_ratio_speed_reaches():
    smollm2 = board.PLANS[("smollm2-135m", 4096)]
    assert smollm2.compression_ratios() == "0.267,0.133"  # SPEED-22 and SPEED-26
    assert board.PLANS[("qwen2.5-coder-0.5b", 4096)].compression_ratios() == "0.250"


def test_docs_refresh_replaces_only_the_fenced_tables():
    begin, end = board.docs_markers("m-4096")
    page = f"# Title\n\nprose before\n\n{begin}\n\n| old |\n\n{end}\n\nprose after\n"
    fresh = board.refresh_docs(page, "m-4096", "| new |\n")
    assert fresh == f"# Title\n\nprose before\n\n{begin}\n\n| new |\n\n{end}\n\nprose after\n"
    assert board.refresh_docs(fresh, "m-4096", "| new |") == fresh  # idempotent
    with pytest.raises(SystemExit, match="no single fenced region for m-8192"):
        board.refresh_docs(page, "m-8192", "| new |")


def test_the_published_page_is_fenced_for_the_4k_board():
    page = (ROOT / "docs" / "ruler.md").read_text()
    begin, end = board.docs_markers("smollm2-135m-4096")
    assert page.count(begin) == page.count(end) == 1


def test_later_plans_share_one_prefill_and_the_4k_board_keeps_its_own():
    for key, plan in board.PLANS.items():
        sweeps = board.sweeps(plan)
        for name in ("base", "adapter"):
            shared = "--shared-prefill" in sweeps[name].args
            assert shared is (key != ("smollm2-135m", 4096)), (key, name)
        if "agnostic" in sweeps:  # a context cached before its question is each method's own
            assert "--shared-prefill" not in sweeps["agnostic"].args
