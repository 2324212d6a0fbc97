"""benchmarks/kvpress_peer.py's driver: jobs split from our RULER samples, and kvpress's
answers turned into `speedkv eval`-shaped records the leaderboard reads (kvpress itself runs in
its own environment, `make kvpress-venv`, and is not needed here)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from speedkv.evals import leaderboard as lb
from speedkv.evals import ruler

from helpers import load_benchmark

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("long_context_eval", "nltk", "punkt")),
    reason="the speedkv[ruler] extra is not installed",
)


@pytest.fixture(scope="module")
def peer():
    return load_benchmark("kvpress_peer")


@pytest.fixture(scope="module")
def samples(smol_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("ruler")
    tasks = ["ruler/niah_single_1", "ruler/vt"]
    ruler.ensure_samples(smol_tokenizer, [(t, 1024, 2) for t in tasks], 0, root)
    loaded = {t: ruler.load_samples(smol_tokenizer, t, 1024, 0, 2, root) for t in tasks}
    return [(t, i, loaded[t][i]) for i in range(2) for t in tasks]


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
        result(peer, job, "snapkv", "agnostic", " 1234.", 733, 2.2),
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

    # the leaderboard reads them as kvpress rows of the query-agnostic setting
    run = tmp_path / "kv"
    run.mkdir()
    lines = [json.dumps({"header": {"peer": "kvpress"}})] + [json.dumps(r) for r in records]
    (run / "records.jsonl").write_text("\n".join(lines) + "\n")
    rows_read = lb.rows_from_runs([run])
    assert {(r.engine, r.setting, r.label) for r in rows_read} == {
        ("kvpress", "agnostic", "kvpress no press"),
        ("kvpress", "agnostic", "kvpress SnapKV"),
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
