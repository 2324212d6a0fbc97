"""RULER query-agnostic: each sample's context cached before its question is seen, then the
question asked from that cache (`speedkv eval --query-agnostic`)."""

from __future__ import annotations

import importlib.util

import pytest

from speedkv.errors import UserError
from speedkv.evals import ruler
from speedkv.evals.report import summarise
from speedkv.evals.runner import EvalConfig, EvalRunner

from helpers import RULER_SAMPLES, ruler_length

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("long_context_eval", "nltk", "punkt")),
    reason="the speedkv[ruler] extra is not installed",
)

OPENING = {"ruler/niah_single_1": "\nWhat", "ruler/vt": "\nQuestion:", "ruler/qa_1": "\n\nAnswer"}
LENGTH = {task: ruler_length(task) for task in OPENING}  # 1024, 1024, 2048
N = RULER_SAMPLES
SPEED = "speed:lcut=2,anchors=bos,deep=1"


@pytest.mark.parametrize("task", list(LENGTH))
def test_context_tokens_end_where_the_question_starts(smol_tokenizer, ruler_root, task):
    for sample in ruler.load_samples(smol_tokenizer, task, LENGTH[task], 0, N, ruler_root):
        k = ruler.context_tokens(smol_tokenizer, sample)
        rest = smol_tokenizer.decode(sample.prompt.ids[k:])
        assert rest.startswith(OPENING[task]), rest[:40]
        assert 20 < len(sample.prompt.ids) - k < 120  # the question, template end, reply start
        _, question, _ = ruler.split_question(sample.input, ruler.task_spec(task))
        assert question.strip() in rest


def run(
    word_model, ruler_root, tmp_path, methods, agnostic, task="ruler/niah_single_1", shared=False
):
    config = EvalConfig(
        model="tiny-words", methods=methods, tasks=[task], lengths=[LENGTH[task]],
        n={task: N}, ruler_data=str(ruler_root), query_agnostic=agnostic, shared_prefill=shared,
    )  # fmt: skip
    out = tmp_path / ("agnostic" if agnostic else "aware") / ("shared" if shared else "own")
    return EvalRunner(word_model, config, out).run(progress=False, plots=False)["records"]


def test_full_answers_the_same_from_a_cached_context(word_model, ruler_root, tmp_path):
    """Full attention computes every token the same whatever follows it: caching the context
    first changes nothing but the order of work."""
    aware = run(word_model, ruler_root, tmp_path, ["full", SPEED], agnostic=False)
    agnostic = run(word_model, ruler_root, tmp_path, ["full", SPEED], agnostic=True)
    for a, b in zip(aware, agnostic):
        assert (a["method"], a["sample"]) == (b["method"], b["sample"])
        assert b["setting"] == "agnostic" and "setting" not in a
        assert 0 < b["context_tokens"] < b["prompt_tokens"] == a["prompt_tokens"]
    fulls = [(a, b) for a, b in zip(aware, agnostic) if a["method"] == "full"]
    assert all(a["answer"] == b["answer"] and a["kv_bytes"] == b["kv_bytes"] for a, b in fulls)
    # SPEED-2 of 4 layers: the context's cache was made with its own last token deep, so the
    # upper two layers hold one token more (anchor, context end, prompt end) than when the whole
    # prompt is prefilled at once (anchor, prompt end)
    full = fulls[0][0]
    per_token_layer = full["kv_bytes"] // (full["prompt_tokens"] * 4)
    speeds = [(a, b) for a, b in zip(aware, agnostic) if a["method"] != "full"]
    for a, b in speeds:
        assert b["kv_bytes"] - a["kv_bytes"] == 2 * per_token_layer


@pytest.mark.parametrize("task", ["ruler/niah_single_1", "ruler/vt"])
def test_shared_prefill_gives_the_answers_and_caches_of_separate_prefills(
    word_model, ruler_root, tmp_path, task
):
    """--shared-prefill: full and every SPEED method start from one full prefill of the
    prompt; the answers and caches are those of each method's own prefill. SPEED's TTFT is
    then not measured, and the report shows none."""
    methods = ["full", SPEED, "speed:lcut=1,anchors=sink:4,deep=5", "snapkv:retain=0.5"]
    own = run(word_model, ruler_root, tmp_path, methods, agnostic=False, task=task)
    shared = run(word_model, ruler_root, tmp_path, methods, agnostic=False, task=task, shared=True)
    assert len(own) == len(shared) == len(methods) * N
    for a, b in zip(own, shared):
        assert (a["method"], a["sample"], a["answer"]) == (b["method"], b["sample"], b["answer"])
        assert a["kv_bytes"] == b["kv_bytes"]
        took = b["method"].startswith("speed") or b["method"] == "full"
        assert b.get("prefill_shared", False) is took
        assert "setting" not in b and "context_tokens" not in b  # the question was in view
        untimed = b["method"].startswith("speed")
        assert (b["ttft_s"] is None, b["ttft_ratio"] is None) == (untimed, untimed)
    recorded = list(dict.fromkeys(r["method"] for r in shared))
    summary = {(r["method"], r["task"]): r for r in summarise(shared, recorded, [task])}
    assert len(summary) == 2 * len(methods)  # the task and RULER's average, per method
    for (method, _), row in summary.items():
        assert (row["ttft_ratio"] is None) is method.startswith("speed")


def test_shared_prefill_is_refused_with_query_agnostic(word_model, ruler_root, tmp_path):
    with pytest.raises(UserError, match="--shared-prefill does not go with --query-agnostic"):
        run(word_model, ruler_root, tmp_path, ["full", SPEED], agnostic=True, shared=True)


def test_methods_that_choose_their_cache_with_the_question_are_refused(word_model, tmp_path):
    config = EvalConfig(
        model="tiny-words", methods=["full", "snapkv"], tasks=["ruler/vt"], lengths=[1024],
        n={"ruler/vt": 1}, query_agnostic=True,
    )  # fmt: skip
    with pytest.raises(UserError, match="--query-agnostic .* snapkv"):
        EvalRunner(word_model, config, tmp_path)


def test_only_ruler_tasks_run_query_agnostic(word_model, tmp_path):
    config = EvalConfig(
        model="tiny-words", methods=["full"], tasks=["niah"], lengths=[1024], n={"niah": 1},
        query_agnostic=True,
    )  # fmt: skip
    with pytest.raises(UserError, match="RULER tasks only, not niah"):
        EvalRunner(word_model, config, tmp_path)
