"""The layer-wise cutoff diagnostic and choose-lcut: attention weights against transformers'
own, the shared-pass cutoff sweep against evaluating each cutoff on its own, the engine's
decode path, budgets and CLI errors."""

import json
import math
from pathlib import Path

import pytest
import torch
from test_cli import run_cli

from speedkv.analysis.cutoff import (
    expected_savings,
    parse_budget,
    parse_candidates,
    separate_logits,
    shared_logits,
    smallest_meeting,
    sweep,
)
from speedkv.analysis.dense import speed_dense_forward
from speedkv.analysis.diagnose import (
    CATEGORIES,
    candidate_cutoffs,
    depth_curvature,
    diagnose,
    prompt_entropy,
    token_curvature,
    trace,
)
from speedkv.core.registry import make_policy
from speedkv.errors import UserError

from conftest import random_prompt

P = 30  # prompt length of the tiny traces


# -- the trace --------------------------------------------------------------------------------
def test_attention_weights_equal_transformers_eager(tiny):
    ids = random_prompt(40)
    t = trace(tiny.backbone, ids, P)
    out = tiny.hf_model(torch.tensor([ids]), output_attentions=True)
    ref = torch.stack([a[0, :, P:, :].float() for a in out.attentions])  # [L, H, g, T]
    assert torch.allclose(t.mass["prefill"], ref[..., 1 : P - 1].sum(-1).mean(1), atol=1e-5)
    assert torch.allclose(t.mass["bos"], ref[..., 0].mean(1), atol=1e-5)
    assert torch.allclose(t.mass["prompt_end"], ref[..., P - 1].mean(1), atol=1e-5)
    total = sum(t.mass[c] for c in CATEGORIES)
    assert torch.allclose(total, torch.ones_like(total), atol=1e-5)
    assert t.steps == 10 and t.entropy.shape == (6, 10)


@pytest.mark.parametrize("lcut", [0, 2, 5])
def test_trace_logits_equal_dense_speed(tiny, lcut):
    ids = random_prompt(40)
    t = trace(tiny.backbone, ids, P, lcut, anchors=1, deep=1)
    ref, pos = speed_dense_forward(tiny.backbone, torch.tensor(ids), P, lcut)
    assert torch.allclose(t.logits, ref[pos >= P], atol=1e-5)
    # above the cutoff no shallow prompt token exists: no attention to them, no entropy
    assert t.mass["prefill"][lcut:].abs().max().item() == 0
    assert torch.isnan(t.entropy[lcut:]).all()
    assert (t.mass["prompt_end"][lcut:] > 0).all()  # the deep suffix stays visible
    assert not torch.isnan(t.entropy[:lcut]).any()


def test_prompt_entropy_hand_cases():
    prefill = torch.tensor([[False, True, True, True, True], [False, True, False, False, False]])
    probs = torch.tensor(
        [[[0.6, 0.1, 0.1, 0.1, 0.1], [0.5, 0.5, 0.0, 0.0, 0.0]]]
    )  # [heads=1, g=2, n=5]
    out = prompt_entropy(probs, prefill)
    assert out[0, 0].item() == pytest.approx(1.0)  # uniform over 4 prefill keys
    assert math.isnan(out[0, 1].item())  # a single prefill key: undefined
    one_hot = prompt_entropy(torch.tensor([[[0.5, 0.5, 0.0, 0.0, 0.0]]]), prefill[:1])
    assert one_hot.item() == pytest.approx(0.0)


def test_curvatures_hand_cases():
    # a straight path across layers, then a right-angle turn
    states = torch.tensor([[0.0, 0.0], [1.0, 0.0], [2.0, 0.0], [2.0, 1.0]])[:, None, :]
    depth = depth_curvature(states)
    assert math.isnan(depth[0]) and math.isnan(depth[-1])
    assert depth[1:-1, 0].tolist() == pytest.approx([0.0, 90.0])
    # token trajectory in one layer: straight -> 0, zig-zag at right angles -> 90
    straight = torch.tensor([[[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]])
    zigzag = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [2.0, 1.0]]])
    assert token_curvature(straight).tolist() == pytest.approx([0.0], abs=1e-3)
    assert token_curvature(zigzag).tolist() == pytest.approx([90.0])
    assert math.isnan(token_curvature(straight[:, :2])[0])


def test_candidate_cutoffs_hand_case():
    full = {
        "attention": {"prefill": [0.5, 0.3, 0.1, 0.05, 0.05]},
        "token_curvature": [120.0, 110.0, 101.0, 100.0, 100.5, 100.2],
    }
    # cumulative prefill share 0.5, 0.8, 0.9 -> three layers; curvature drop 20, 90% at layer 2
    assert candidate_cutoffs(full) == {"prefill_attention_90": 3, "straightening_90": 2}


def test_diagnose_end_to_end(tiny_engine, tmp_path):
    from speedkv.analysis.diagnose_plots import write_figures

    prompts = [random_prompt(24, seed=s) for s in (1, 2, 3)]
    result = diagnose(tiny_engine, prompts, new_tokens=6, lcut=3, deep=1, progress=False)
    full, speed = result["variants"]["full"], result["variants"]["speed"]
    # the dense traces reproduce the engine's own greedy decode
    assert full["trace_engine_agreement"] == 1.0 and speed["trace_engine_agreement"] == 1.0
    assert full["tokens"] == 18 and full["heatmap_prompts"] == [3] * 6
    for layer in range(6):
        assert sum(full["attention"][c][layer] for c in CATEGORIES) == pytest.approx(1, abs=1e-5)
    assert speed["attention"]["prefill"][3:] == [0.0, 0.0, 0.0]
    assert all(v == 0.0 for row in speed["heatmap_prefill"][3:] for v in row)
    assert speed["spec"] == "speed:lcut=3,anchors=bos,deep=1,selfonly=false"
    paths = write_figures(result, tmp_path)
    assert all(p.stat().st_size > 10_000 for p in paths)
    json.dumps(result)  # JSON-ready, no NaN or tensors
    assert "NaN" not in json.dumps(result)


# -- the shared-pass sweep --------------------------------------------------------------------
@pytest.mark.parametrize("anchors, deep", [(1, 1), (0, 1), (4, 3)])
def test_shared_logits_equal_separate(tiny, anchors, deep):
    ids = torch.tensor(random_prompt(48))
    cuts = list(range(7))
    shared = {
        c: (lg, pos) for c, lg, pos in shared_logits(tiny.backbone, ids, 36, cuts, anchors, deep)
    }
    alone = {
        c: (lg, pos) for c, lg, pos in separate_logits(tiny.backbone, ids, 36, cuts, anchors, deep)
    }
    for cut in cuts:
        assert torch.equal(shared[cut][1], alone[cut][1])
        assert torch.allclose(shared[cut][0], alone[cut][0], atol=1e-5), cut


def test_sweep_numbers_equal_separate_and_full_is_exact(tiny):
    passages = [random_prompt(40, seed=s) for s in (4, 5)]
    cuts = [0, 1, 3, 5, 6]
    shared = sweep(tiny.backbone, passages, 32, cuts, progress=False)
    alone = sweep(tiny.backbone, passages, 32, cuts, shared=False, progress=False)
    for cut in cuts:
        for key in ("agreement", "ppl", "ppl_ratio", "kl"):
            assert shared.rows[cut][key] == pytest.approx(alone.rows[cut][key], rel=1e-5, abs=1e-5)
        assert shared.rows[cut]["positions"] == 16
    top = shared.rows[6]
    assert (top["agreement"], top["ppl_ratio"], top["kl"]) == (1.0, 1.0, 0.0)
    assert shared.rows[0]["agreement"] < 1.0


def test_sweep_against_another_models_full_attention(tiny):
    """With an adapter the cutoffs are compared with the base model: a reference identical to
    the swept model changes nothing, a different one moves even the top cutoff off 1.0."""
    from conftest import tiny_model

    passages = [random_prompt(40, seed=s) for s in (4, 5)]
    own = sweep(tiny.backbone, passages, 32, [3, 6], progress=False)
    same = sweep(tiny.backbone, passages, 32, [3, 6], progress=False, reference=tiny.backbone)
    assert own.rows == same.rows
    other = tiny_model(tiny.shape.model_type, seed=9).backbone
    moved = sweep(tiny.backbone, passages, 32, [6], progress=False, reference=other)
    assert moved.rows[6]["kl"] > 0.0


def test_sweep_matches_the_engine_decode_path(tiny_engine):
    """Cutoff logits from the shared pass equal SPEED's real prefill + teacher-forced decode."""
    ids = random_prompt(40, seed=7)
    prompt, cont = ids[:32], ids[32:]
    results = dict(
        (c, lg) for c, lg, _ in shared_logits(tiny_engine.backbone, torch.tensor(ids), 32, [2, 4])
    )
    for cut in (2, 4):
        policy = make_policy(f"speed:lcut={cut},anchors=bos,deep=1", tiny_engine.shape)
        done = tiny_engine.prefill_ids(prompt, policy, spare=len(cont))
        rows = [done.logits]
        for i, token in enumerate(cont[:-1]):
            step = tiny_engine.decode_step([done.cache], [policy], [token], [32 + i])
            rows.append(step[0])
        # full-depth rows: BoS, the last prompt token, then the continuation
        assert torch.allclose(torch.stack(rows), results[cut][1 : 1 + len(cont)], atol=1e-4)


# -- budgets, candidates, choice, cost model --------------------------------------------------
def test_parse_budget():
    assert parse_budget("agreement=0.95") == {"agreement": 0.95}
    assert parse_budget("agreement=0.9, ppl_ratio=1.1") == {"agreement": 0.9, "ppl_ratio": 1.1}
    for bad, message in [
        ("accuracy=0.9", "not understood"),
        ("agreement", "not understood"),
        ("agreement=high", "not a number"),
        ("agreement=1.5", "in (0, 1]"),
        ("ppl_ratio=0.9", "at least 1"),
        ("kl=-1", "at least 0"),
        ("agreement=nan", "in (0, 1]"),
    ]:
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace("]", r"\]")):
            parse_budget(bad)


def test_parse_candidates():
    assert parse_candidates("0..3", 6) == [0, 1, 2, 3]
    assert parse_candidates("5,1..2,5", 6) == [1, 2, 5]
    for bad in ("0..7", "-1", "a..b", "4..2", ""):
        with pytest.raises(UserError):
            parse_candidates(bad, 6)


def test_smallest_meeting_needs_every_larger_cutoff_to_meet():
    rows = {c: {"agreement": a} for c, a in [(2, 0.97), (3, 0.90), (4, 0.96), (5, 1.0)]}
    assert smallest_meeting(rows, {"agreement": 0.95}) == 4  # 2 meets only by luck
    assert smallest_meeting(rows, {"agreement": 0.85}) == 2
    assert smallest_meeting({4: {"agreement": 0.5}}, {"agreement": 0.95}) is None


def test_expected_savings(tiny):
    shape = tiny.shape
    assert expected_savings(shape, 6, 100)["ttft_ratio"] == pytest.approx(1.0)
    s = expected_savings(shape, 3, 100, anchors=1, deep=1)
    assert s["kv_ratio"] == pytest.approx((3 * 100 + 3 * 2) / (6 * 100))
    assert 0.5 < s["ttft_ratio"] < 0.52 and s["decode_flops_ratio"] < 1.0


# -- command line -----------------------------------------------------------------------------
NOT_JSON = str(Path(__file__).resolve().parents[2] / "pyproject.toml")


@pytest.mark.parametrize(
    "args, message",
    [
        (["choose-lcut", "--budget", "accuracy=0.9"], "is not understood"),
        (["choose-lcut", "--budget", "agreement=2"], "must be in (0, 1]"),
        (["choose-lcut", "--anchors", "last"], "anchors must be"),
        (["choose-lcut", "--adapter", "/tmp/x"], "is not an adapter directory"),
        (["choose-lcut", "--samples", "0"], "samples must be at least 1"),
        (["choose-lcut", "--deep", "0"], "--deep': Input should be greater than or equal to 1"),
        (["diagnose", "--deep", "0"], "--deep': Input should be greater than or equal to 1"),
        (["choose-lcut", "--plot-with", NOT_JSON], "give --plot PATH too"),
        (["choose-lcut", "--plot", "x.png", "--plot-with", NOT_JSON], "not choose-lcut's"),
        (["diagnose", "--prompts-file", "/nonexistent.txt"], "does not exist"),
        (["diagnose", "--max-new-tokens", "1"], "--max-new-tokens must be at least 3"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2(args, message, monkeypatch, capsys):
    code, _, err = run_cli(args, monkeypatch, capsys)
    assert code == 2 and message in err and "Traceback" not in err


def test_bad_prompt_files(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    for path, message in [(empty, "has no prompts"), (binary, "is not UTF-8")]:
        code, _, err = run_cli(["diagnose", "--prompts-file", str(path)], monkeypatch, capsys)
        assert code == 2 and message in err


@pytest.mark.real_model
def test_choose_lcut_on_smollm2(smollm2, monkeypatch, capsys):
    args = ["choose-lcut", "--samples", "1", "--prompt-tokens", "64", "--continuation-tokens", "8"]
    args += ["--candidates", "26,28..30", "--budget", "agreement=0.5", "--deep", "1", "--json"]
    code, out, _ = run_cli(args, monkeypatch, capsys, model=smollm2)
    result = json.loads(out)
    assert code == 0 and result["cutoffs"]["30"]["agreement"] == 1.0
    assert result["lcut"] in (26, 28, 29, 30)
    assert result["spec"].startswith(f"speed:lcut={result['lcut']},anchors=bos,deep=1")
    assert 0 < result["savings"]["kv_saving"] < 0.2


@pytest.mark.real_model
def test_choose_lcut_plots_sweeps_together(smollm2, tmp_path, monkeypatch, capsys):
    args = ["choose-lcut", "--samples", "1", "--prompt-tokens", "64", "--continuation-tokens", "8"]
    args += ["--candidates", "28..30", "--deep", "1", "--json"]
    code, out, _ = run_cli([*args, "--anchors", "none"], monkeypatch, capsys, model=smollm2)
    saved = tmp_path / "none.json"
    saved.write_text(out)
    figure = tmp_path / "sweeps.png"
    plotted = [*args, "--plot", str(figure), "--plot-with", str(saved)]
    code, out, _ = run_cli(plotted, monkeypatch, capsys, model=smollm2)
    assert code == 0 and json.loads(out)["anchors_spec"] == "bos"
    assert json.loads(saved.read_text())["anchors_spec"] == "none"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
