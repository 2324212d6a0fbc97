"""benchmarks/kvpress_peer.py's driver: jobs split from our RULER samples, and kvpress's
answers turned into `speedkv eval`-shaped records the leaderboard reads (kvpress itself runs in
its own environment, `make kvpress-venv`, and is not needed here)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from speedkv.evals import ruler
from speedkv.leaderboard import rows as lb_rows

from helpers import RULER_SAMPLES, load_benchmark, ruler_length

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("long_context_eval", "nltk", "punkt")),
    reason="the speedkv[ruler] extra is not installed",
)


@pytest.fixture(scope="module")
def peer():
    return load_benchmark("kvpress_peer")


@pytest.fixture(scope="module")
def samples(smol_tokenizer, ruler_root):
    tasks = ["ruler/niah_single_1", "ruler/vt"]  # at 1024 tokens, 2 samples each (conftest)
    loaded = {
        t: ruler.load_samples(smol_tokenizer, t, ruler_length(t), 0, RULER_SAMPLES, ruler_root)
        for t in tasks
    }
    return [(t, i, loaded[t][i]) for i in range(RULER_SAMPLES) for t in tasks]


def test_jobs_carry_the_prompt_split_at_its_question(peer, samples):
    jobs = peer.make_jobs(samples, 1024)
    assert [j["key"] for j in jobs] == [
        "ruler/niah_single_1@1024#0", "ruler/vt@1024#0",
        "ruler/niah_single_1@1024#1", "ruler/vt@1024#1",
    ]  # fmt: skip
    for job, (task, _, sample) in zip(jobs, samples):
        spec = ruler.task_spec(task)
        prefix = ruler.split_question(sample.input, spec)[2]
        assert job["context"] + job["question"] + prefix == sample.input
        assert job["ids"] == sample.prompt.ids and job["answer_prefix"] == sample.reply_start
        assert job["max_new_tokens"] == spec.tokens_to_generate


def result(peer, job: str, press: str, setting: str, answer: str, kv: int, ttft: float) -> dict:
    return {
        "job": job,
        "method": peer.method_name(press, None if press == peer.NONE else 0.267, setting),
        "answer": answer,
        "output_tokens": 3,
        "finish_reason": "stop",
        "kv_bytes": kv,
        "kv_bytes_effective": kv,
        "ttft_s": ttft,
        "seconds": 2 * ttft,
        "prefill_s": ttft,
        "setting": setting,
        "press": press,
        "ratio": None if press == peer.NONE else 0.267,
        "context_tokens": 900,
        "question_tokens": 40,
        "kv_bytes_context": kv,
        "ids_match": True,
        "threads": 1,
    }


def test_records_are_scored_against_the_reference_and_ranked(peer, samples, tmp_path):
    task, index, sample = samples[0]
    job = peer.job_key(task, 1024, index)
    needle = sample.outputs[0]
    rows = [
        result(peer, job, peer.NONE, "agnostic", f" {needle}.", 1000, 2.0),
        result(peer, job, "snapkv", "agnostic", " 1234.", 733, 2.2) | {"machine": "cpu A"},
        result(peer, job, "snapkv", "aware", f" {needle}.", 733, 2.1),  # no reference yet
    ]
    records, mismatches = peer.build_records(samples, 1024, rows)
    assert not mismatches
    by_method = {r["method"]: r for r in records}
    assert set(by_method) == {
        "kvpress:none,setting=agnostic",
        peer.method_name("snapkv", 0.267, "agnostic"),
    }
    full, snap = (
        by_method["kvpress:none,setting=agnostic"],
        by_method[peer.method_name("snapkv", 0.267, "agnostic")],
    )
    assert full["score"] == 1.0 and snap["score"] == 0.0
    assert snap["kv_ratio"] == pytest.approx(0.733) and snap["ttft_ratio"] == pytest.approx(1.1)
    assert snap["input_sha"] == sample.input_sha and snap["setting"] == "agnostic"
    assert snap["machine"] == "cpu A" and full["machine"] is None  # None: answered before

    # the leaderboard reads them as kvpress rows of the query-agnostic setting
    run = tmp_path / "kv"
    run.mkdir()
    lines = [json.dumps({"header": {"peer": "kvpress"}})] + [json.dumps(r) for r in records]
    (run / "records.jsonl").write_text("\n".join(lines) + "\n")
    rows_read = lb_rows.rows_from_runs([run])
    assert {(r.engine, r.setting, r.label) for r in rows_read} == {
        ("kvpress", "agnostic", "kvpress no press"),
        ("kvpress", "agnostic", "kvpress SnapKV (KV 0.733)"),
    }
    scored = {r.label: (r.counts, r.scores) for r in rows_read}
    assert scored == {
        "kvpress no press": ({task: 1}, {task: 1.0}),
        "kvpress SnapKV (KV 0.733)": ({task: 1}, {task: 0.0}),
    }


def test_a_token_mismatch_is_reported(peer, samples):
    task, index, sample = samples[1]
    job = peer.job_key(task, 1024, index)
    rows = [
        result(peer, job, peer.NONE, "aware", " X", 1000, 2.0)
        | {"ids_match": False, "kvpress_tokens": 5, "first_mismatch": 3}
    ]
    _, mismatches = peer.build_records(samples, 1024, rows)
    assert mismatches and "differ from the prompt's" in mismatches[0]


@pytest.mark.parametrize("rows", [16, 1])
def test_bfloat16_products_go_through_float32_where_onednn_refuses_bfloat16(peer, rows):
    """Where oneDNN takes no bfloat16, a product is bfloat16 operands summed in float32 and
    rounded once, by float32's kernels; elsewhere the layers are left as they are."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 8, bias=False))
    model = model.to(torch.bfloat16)
    x = torch.randn(1, rows, 64, dtype=torch.bfloat16)
    assert not peer.products_in_float32(model, onednn_bf16=True)
    assert "forward" not in vars(model[0])
    assert peer.products_in_float32(model, onednn_bf16=False)
    first, second = model[0], model[1]
    hidden = F.linear(x.float(), first.weight.float(), first.bias.float()).bfloat16()
    expected = F.linear(hidden.float(), second.weight.float()).bfloat16()
    out = model(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)


def test_attention_in_float32_upcasts_a_bfloat16_call_and_rounds_once(peer):
    """The cache stays bfloat16; the attention call sees its operands upcast exactly (a float
    mask too) and returns its output rounded once, through whatever entry kvpress wrapped."""
    import torch
    import torch.nn.functional as F
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    seen = []

    def sdpa(module, query, key, value, attention_mask, *args, **kwargs):
        seen.append((query.dtype, key.dtype, value.dtype, attention_mask.dtype))
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask)
        return out.transpose(1, 2), None

    saved = ALL_ATTENTION_FUNCTIONS[peer.ATTENTION]
    ALL_ATTENTION_FUNCTIONS[peer.ATTENTION] = sdpa
    try:
        peer.attention_in_float32()
        patched = ALL_ATTENTION_FUNCTIONS[peer.ATTENTION]
        peer.attention_in_float32()  # once only: not wrapped twice
        assert ALL_ATTENTION_FUNCTIONS[peer.ATTENTION] is patched
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 2, n, 16, dtype=torch.bfloat16) for n in (3, 40, 40))
        mask = torch.zeros(1, 1, 3, 40, dtype=torch.bfloat16)
        mask[..., :5] = torch.finfo(torch.bfloat16).min
        out, _ = patched(None, q, k, v, mask, dropout=0.0)
        expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                  attn_mask=mask.float())  # fmt: skip
        assert seen == [(torch.float32,) * 4]
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, expected.transpose(1, 2).bfloat16())
        patched(None, q.float(), k.float(), v.float(), mask.float(), dropout=0.0)
        assert seen[-1] == (torch.float32,) * 4  # float32 models pass through as they are
    finally:
        ALL_ATTENTION_FUNCTIONS[peer.ATTENTION] = saved


KVPRESS_PYTHON = ROOT / ".venv-kvpress" / "bin" / "python"


@pytest.mark.skipif(not KVPRESS_PYTHON.exists(), reason="no kvpress environment")
def test_shared_prefills_give_the_pipeline_calls_answers(peer, samples, smol_tokenizer, tmp_path):
    """The kvpress half's two shortcuts against one pipeline call per press and ratio: the
    scorer presses (and press=None) share one prefill, KVzip's ratios one prefill and one
    replay. Every answer, token count, cache size and masked share must be the pipeline's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(smol_tokenizer), hidden_size=128, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    # head_dim 64: KVzip's masks need a key no query attends to, which 8 dimensions lack
    model_dir = tmp_path / "model"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    smol_tokenizer.save_pretrained(model_dir)
    jobs = peer.make_jobs(samples[:2], 1024)
    for job in jobs:
        job["max_new_tokens"] = 12  # a random model: its answers only have to be equal
    results = {}
    for share in (False, True):
        spec = {
            "model": str(model_dir), "threads": 1, "presses": list(peer.PRESSES),
            "share_prefill": share, "ratios": [0.267, 0.133],
            "settings": list(peer.SETTINGS), "jobs": jobs, "machine": f"cpu {share}",
        }  # fmt: skip
        path = tmp_path / f"jobs-{share}.json"
        path.write_text(json.dumps(spec))
        out = tmp_path / f"results-{share}.jsonl"
        done = subprocess.run(
            [str(KVPRESS_PYTHON), str(ROOT / "benchmarks" / "kvpress_peer.py"), "--run",
             str(path), "--results", str(out)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        results[share] = {(r["job"], r["method"]): r for r in rows}
    own, shared = results[False], results[True]
    # 2 jobs x 2 settings x (press=None + 6 presses x 2 ratios)
    assert len(own) == len(shared) == 2 * 2 * 13
    assert all(r.get("prefill_shared", False) is False for r in own.values())
    assert all(r["prefill_shared"] for r in shared.values())
    assert {r["machine"] for r in shared.values()} == {"cpu True"}  # each answer says where
    fields = ("answer", "output_tokens", "kv_bytes", "kv_bytes_context", "kv_bytes_effective",
              "layer_lengths", "press_repr", "ids_match")  # fmt: skip
    for key, row in own.items():
        assert {f: shared[key][f] for f in fields} == {f: row[f] for f in fields}, key
    kvzip = [r for r in own.values() if r["press"] == "kvzip"]
    assert all(r["kv_bytes_effective"] < r["kv_bytes"] for r in kvzip)  # its masks were set


def test_a_sweep_resumes_wherever_the_converted_weights_live(peer):
    header = {"peer": "kvpress", "model": "smollm2-135m", "hf_model": "/a/SmolLM2-1", "seed": 0}
    moved = {**header, "hf_model": "/b/SmolLM2-2"}
    assert peer.same_run(header, moved)
    assert not peer.same_run(header, {**moved, "seed": 1})
    assert not peer.same_run(header, {**moved, "model": "qwen2.5-coder-0.5b"})


def test_a_run_keeps_the_attention_numerics_its_answers_were_made_with(peer):
    """Answers written before headers named their attention were made by bfloat16 SDPA; a
    resumed run keeps its header's choice on any machine, a new one takes this machine's."""
    import torch

    before = {"peer": "kvpress", "model": "smollm2-135m", "seed": 0}
    assert peer.attention_numerics(before) == peer.ATTENTION_IN_BFLOAT16
    assert peer.same_run(before, {**before, "attention": peer.ATTENTION_IN_BFLOAT16})
    assert not peer.same_run(before, {**before, "attention": peer.ATTENTION_IN_FLOAT32})
    upcast = {**before, "attention": peer.ATTENTION_IN_FLOAT32}
    assert peer.attention_numerics(upcast) == peer.ATTENTION_IN_FLOAT32
    fast_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    new = peer.ATTENTION_IN_BFLOAT16 if fast_bf16 else peer.ATTENTION_IN_FLOAT32
    assert peer.attention_numerics(None) == new


def test_a_heads_width_comes_from_llama_and_qwen2_configs(peer):
    from transformers import LlamaConfig, Qwen2Config

    qwen = Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2)
    assert peer.head_dim(qwen) == 64  # Qwen2.5-0.5B's: its config has no head_dim
    assert peer.head_dim(LlamaConfig(hidden_size=576, num_attention_heads=9, head_dim=64)) == 64


@pytest.mark.skipif(not KVPRESS_PYTHON.exists(), reason="no kvpress environment")
def test_records_only_rewrites_a_parts_records_from_its_answers(peer, samples, ruler_root,
                                                               tmp_path):  # fmt: skip
    """`--records-only` scores every answer in --out so far and replaces records.jsonl whole,
    running nothing; a part with no answers is refused."""
    import argparse

    out = tmp_path / "kvpress-1of1"
    options = ["--kvpress-python", str(KVPRESS_PYTHON), "--model", "smollm2-135m",
               "--tasks", "ruler/niah_single_1,ruler/vt", "--length", "1024",
               "--samples", str(RULER_SAMPLES), "--ruler-data", str(ruler_root),
               "--out", str(out), "--records-only"]  # fmt: skip
    command = [sys.executable, str(ROOT / "benchmarks" / "kvpress_peer.py"), *options]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode != 0 and "no answers in" in done.stderr

    args = argparse.Namespace(kvpress_python=str(KVPRESS_PYTHON), model="smollm2-135m",
                              tasks="ruler/niah_single_1,ruler/vt", length=1024,
                              samples=RULER_SAMPLES, seed=0, ruler_data=str(ruler_root),
                              first=None, adapter=None)  # fmt: skip
    header, _, _ = peer.identity(args, peer.attention_numerics(None))
    assert "adapter" not in header  # a base-model run's header is what it always was
    task, index, sample = samples[0]
    job = peer.job_key(task, 1024, index)
    answers = [
        result(peer, job, peer.NONE, "aware", f" {sample.outputs[0]}.", 1000, 2.0),
        result(peer, job, "snapkv", "aware", " 1234.", 733, 2.2),
    ]
    out.mkdir()
    lines = [
        json.dumps({"header": {**header, "hf_model": "/elsewhere"}}),  # another machine's
        *map(json.dumps, answers),
    ]
    (out / "kvpress-results.jsonl").write_text("\n".join(lines) + "\n")
    (out / "records.jsonl").write_text("stale\n")
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    written = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert written[0]["header"] == header
    assert {(r["method"], r["score"]) for r in written[1:]} == {
        ("kvpress:none,setting=aware", 1.0),
        (peer.method_name("snapkv", 0.267, "aware"), 0.0),
    }
    assert not (out / "records.jsonl.partial").exists()
    other = [json.dumps({"header": {**header, "seed": 1}}), *lines[1:]]  # another run's answers
    (out / "kvpress-results.jsonl").write_text("\n".join(other) + "\n")
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode != 0 and "was made with other settings" in done.stderr


@pytest.mark.skipif(not KVPRESS_PYTHON.exists(), reason="no kvpress environment")
def test_an_adapter_runs_the_presses_on_the_merged_weights(peer, ruler_root):
    """--adapter: kvpress loads the model with the adapter merged (the directory speedkv's
    vLLM backend runs), and the header names the adapter, so a resumed run keeps it."""
    import argparse

    from speedkv.hf.adapters import merged_directory

    adapter = ROOT / "adapters" / "smollm2-135m-speed22-bos-pydocs"
    args = argparse.Namespace(kvpress_python=str(KVPRESS_PYTHON), model="smollm2-135m",
                              tasks="ruler/niah_single_1", length=1024, samples=1, seed=0,
                              ruler_data=str(ruler_root), first=None,
                              adapter=str(adapter))  # fmt: skip
    header, model_dir, _ = peer.identity(args, peer.attention_numerics(None))
    assert model_dir == str(merged_directory("smollm2-135m", adapter))
    assert header["adapter"] == str(adapter) and header["hf_model"] == model_dir
