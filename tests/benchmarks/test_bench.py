"""`speedkv bench` on the real model at toy lengths: cells, exact KV ratios, outputs, resume."""

import json

import pytest

from speedkv.bench.report import engine_vs_hf
from speedkv.bench.roofline import MachineLimits
from speedkv.bench.runner import Bench, BenchConfig, add_bounds, rotated
from speedkv.cli.options import parse_lengths, parse_methods
from speedkv.errors import UserError
from speedkv.prompts.builders import exact_chat_prompt

pytestmark = pytest.mark.real_model

SPECS = ["full", "speed:lcut=22,anchors=bos,deep=1"]


def test_prompts_have_the_exact_length_and_chat_framing(smollm2):
    ids = exact_chat_prompt(smollm2.tokenizer, 300)
    assert len(ids) == 300 and ids[0] == smollm2.tokenizer.bos_token_id


def test_cells_ratios_and_outputs(smollm2, tmp_path):
    config = BenchConfig(
        model="smollm2-135m", methods=SPECS, lengths=[96, 160], new_tokens=3, repeats=2
    )
    result = Bench(smollm2, config, tmp_path).run(resume=False, progress=False)
    cells = {(c["method"], c["length"]): c for c in result["cells"]}
    speed = "speed:lcut=22,anchors=bos,deep=1,selfonly=false"
    assert set(cells) == {(m, n) for m in ("full", speed) for n in (96, 160)}
    for n in (96, 160):
        full, cut = cells[("full", n)], cells[(speed, n)]
        assert full["ttft_ratio"] == full["tpot_ratio"] == full["kv_ratio"] == 1.0
        assert cut["kv_ratio"] == pytest.approx((22 * n + 8 * 2) / (30 * n))
        assert cut["flops_prefill_ratio"] < 1.0 and cut["repeats"] == 2
        for key in ("ttft_s", "tpot_s", "kv_bytes", "kv_bytes_final", "peak_rss_bytes"):
            assert cut[key + "_min"] <= cut[key] <= cut[key + "_max"]
    for name in (
        "results.json",
        "results.csv",
        "table.md",
        "report.md",
        "efficiency.png",
        "ttft.png",
        "tpot.png",
        "kv.png",
        "runs.jsonl",
    ):
        assert (tmp_path / name).exists(), name
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["machine"]["torch"] and saved["config"]["repeats"] == 2
    limits = saved["limits"]
    assert limits["bandwidth_gb_s"] > 0.1 and limits["matmul_tflop_s"] > 1e-3
    for cell in result["cells"]:  # the ratio to the limit is reported; its size is measured,
        # so it is not asserted here (the bounds test below checks the arithmetic on given timings)
        assert cell["tpot_x_bound"] > 0 and cell["ttft_x_bound"] > 0
    assert "TPOT/limit" in (tmp_path / "table.md").read_text()


def test_decode_weight_bytes_counts_a_tied_head_once(smollm2):
    hf = smollm2.backbone.hf_model
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    every_parameter = sum(p.numel() * p.element_size() for p in hf.parameters())
    assert smollm2.backbone.decode_weight_bytes() == every_parameter


def test_each_repeat_starts_with_the_next_method():
    methods = ["full", "hf", "speed"]
    assert [rotated(methods, r) for r in range(4)] == [
        ["full", "hf", "speed"],
        ["hf", "speed", "full"],
        ["speed", "full", "hf"],
        ["full", "hf", "speed"],
    ]


def test_bounds_arithmetic():
    limits = MachineLimits(bandwidth_bytes_s=1e9, matmul_flops_s=1e12, dtype="bf16", device="cpu")
    cells = [
        dict(
            method="full",
            length=8,
            flops_prefill=4e12,
            kv_bytes=100,
            kv_bytes_final=300,
            ttft_s=8.0,
            tpot_s=0.02,
        ),
        dict(
            method="hf",
            length=8,
            flops_prefill=None,
            kv_bytes=100,
            kv_bytes_final=300,
            ttft_s=10.0,
            tpot_s=0.04,
        ),
    ]
    add_bounds(cells, limits, weight_bytes=9_999_800)
    full, hf = cells
    assert full["tpot_bound_s"] == pytest.approx(0.01)  # (9_999_800 + 200) / 1e9
    assert full["kv_read_share"] == pytest.approx(200 / 10_000_000)
    assert full["tpot_x_bound"] == pytest.approx(2.0) and hf["tpot_x_bound"] == pytest.approx(4.0)
    assert full["ttft_bound_s"] == hf["ttft_bound_s"] == pytest.approx(4.0)
    assert hf["ttft_x_bound"] == pytest.approx(2.5)


def test_resume_measures_only_missing_runs(smollm2, tmp_path, capsys):
    def config(repeats):
        return BenchConfig(
            model="smollm2-135m", methods=SPECS, lengths=[80], new_tokens=2, repeats=repeats
        )

    Bench(smollm2, config(1), tmp_path).run(resume=False, progress=False)
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 1 + 2
    capsys.readouterr()
    result = Bench(smollm2, config(2), tmp_path).run(resume=True, progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "[bench] machine limits:" in err  # stdout stays for --json
    lines = (tmp_path / "runs.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 4  # the header, repeat 0 kept, repeat 1 added
    assert all(c["repeats"] == 2 for c in result["cells"])
    other = BenchConfig(model="smollm2-135m", methods=SPECS, lengths=[80], new_tokens=5, repeats=2)
    with pytest.raises(UserError, match="other settings"):
        Bench(smollm2, other, tmp_path).run(resume=True, progress=False)


def test_bad_arguments(smollm2, tmp_path):
    with pytest.raises(UserError, match="longer than the model's context"):
        Bench(smollm2, BenchConfig("m", SPECS, [9000]), tmp_path)
    with pytest.raises(UserError, match="repeats must be at least 1"):
        Bench(smollm2, BenchConfig("m", SPECS, [100], repeats=0), tmp_path)
    with pytest.raises(UserError, match="unknown method"):
        Bench(smollm2, BenchConfig("m", ["full", "nosuch"], [100]), tmp_path)
    with pytest.raises(UserError, match="lengths must be"):
        parse_lengths("1024,abc")
    with pytest.raises(UserError, match="at least one method"):
        parse_methods(" ; ")


def test_before_after_table_inverts_hf_ratios():
    full = dict(
        method="full", length=64, ttft_s=1.0, tpot_s=0.05, ttft_x_bound=2.0, tpot_x_bound=5.0
    )
    hf = dict(method="hf", length=64, ttft_s=1.25, tpot_s=0.1, ttft_ratio=1.25, tpot_ratio=2.0)
    table = engine_vs_hf({"config": {"lengths": [64]}, "cells": [full, hf]})
    assert "| 64 | 1.250 | 1.000 | 0.800 | 2.00 | 100.0 | 50.0 | 0.500 | 5.00 |" in table
    assert engine_vs_hf({"config": {"lengths": [64]}, "cells": [full]}) == ""


def test_hf_runs_float32_where_the_cpu_has_no_bf16_products(monkeypatch, tmp_path):
    """`auto` gave bfloat16 (speedkv's kernels run it), but transformers' own layers would run
    bfloat16 products as a plain loop there: `hf` runs a float32 copy, as a user would load it,
    and says so; a dtype the user named is kept."""
    import copy

    import torch

    from speedkv.bench import runner
    from speedkv.hf.loading import LoadedModel

    from conftest import tiny_model

    hf = tiny_model("llama").hf_model.to(torch.bfloat16)
    model = LoadedModel(name="tiny", hf_model=hf, tokenizer=None, source="memory")
    monkeypatch.setattr(runner, "resolve_dtype", lambda *args, **kwargs: torch.float32)
    config = BenchConfig(model="tiny", methods=["hf"], lengths=[16], new_tokens=3, repeats=1)
    bench = Bench(model, config, tmp_path)
    assert bench.model.dtype == torch.bfloat16 and bench.hf_model.dtype == torch.float32
    assert "float32 copy" in bench.notes[0]
    ids = list(range(5, 21))
    row = bench.measure("hf", ids, 3)
    expected = copy.deepcopy(hf).float().generate(torch.tensor([ids]), max_new_tokens=3,
                                                  do_sample=False, pad_token_id=0)  # fmt: skip
    assert row["output_ids"] == expected[0, len(ids) :].tolist()
    per = model.shape.kv_bytes_per_token_layer(torch.float32)
    assert row["kv_bytes"] == len(ids) * model.shape.num_layers * per
    named = BenchConfig(model="tiny", methods=["hf"], lengths=[16], new_tokens=3, dtype="bfloat16")
    assert Bench(model, named, tmp_path).hf_model is model


def test_a_gpu_bench_says_its_decode_steps_were_recorded(monkeypatch, tmp_path):
    from speedkv.core.engine import Engine
    from speedkv.hf.loading import LoadedModel

    from conftest import tiny_model

    model = LoadedModel(name="tiny", hf_model=tiny_model("llama").hf_model, tokenizer=None,
                        source="memory")  # fmt: skip
    config = BenchConfig(model="tiny", methods=["full"], lengths=[16], new_tokens=3, repeats=1)
    assert not Bench(model, config, tmp_path).notes  # a CPU launches its kernels
    monkeypatch.setattr(Engine, "records_graphs", True)  # as on a GPU
    assert "recorded CUDA graph" in Bench(model, config, tmp_path).notes[0]
    monkeypatch.setenv("SPEEDKV_RECORDED_DECODE", "never")
    assert not Bench(model, config, tmp_path).notes
