"""The `reuse` evaluation task (four facts asked over one cached document and with fresh
prefills) and `deep=turn` in the evaluation harness: prompts, records, refusals, resume."""

from __future__ import annotations

import json

import pytest

from speedkv.core.engine import Engine
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.errors import UserError
from speedkv.evals import needles, reuse
from speedkv.evals.documents import document_turn
from speedkv.evals.runner import EvalConfig, EvalRunner

from helpers import run_cli

# tiny models are latency-bound: one thread avoids contention on a shared CPU
pytestmark = pytest.mark.usefixtures("one_thread")

HEADER = "<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine(word_model) -> Engine:
    return Engine(word_model, chunk_size=64)


# -- the documents ------------------------------------------------------------------------------
def test_a_quiz_plants_four_kinds_of_fact_and_fits_its_length(smol_tokenizer):
    quiz = reuse.build_quiz(smol_tokenizer, 600, 1, seed=3)
    assert 594 <= len(quiz.prompt.ids) <= 600
    assert quiz.prompt.ids == document_turn(smol_tokenizer)(quiz.document).ids
    assert not smol_tokenizer.decode(quiz.prompt.ids).endswith("assistant\n")  # no question
    assert [q.kind for q in quiz.questions] == ["number", "city", "name", "date"]
    assert sorted(quiz.depths) == list(reuse.FACT_DEPTHS)
    at = {q.fact: quiz.document.index(q.fact) for q in quiz.questions}
    by_depth = sorted(quiz.questions, key=lambda q: quiz.depths[quiz.questions.index(q)])
    assert [at[q.fact] for q in by_depth] == sorted(at.values())  # planted where drawn
    for q in quiz.questions:
        assert needles.found_values(q.fact, q.expected) == q.expected
        assert needles.found_values(q.text, q.expected) == []  # the question gives nothing away
    longer = reuse.build_quiz(smol_tokenizer, 900, 1, seed=3)
    assert longer.questions == quiz.questions and longer.depths == quiz.depths
    assert reuse.build_quiz(smol_tokenizer, 600, 2, seed=3).questions != quiz.questions


def test_the_reused_prompt_is_the_fresh_prompt(engine, smol_tokenizer):
    quiz = reuse.build_quiz(smol_tokenizer, 300, 0, seed=0)
    cached = engine.prefill(quiz.document, "full")
    assert cached.ids == quiz.prompt.ids
    for question in quiz.questions:
        fresh = reuse.fresh_prompt(smol_tokenizer, quiz, question)
        continued = engine.continuation(cached, question.text, SamplingParams())
        assert continued.ids == fresh.ids
        assert (continued.header_tokens, continued.turn_tokens) == (
            fresh.header_tokens,
            fresh.turn_tokens,
        )
        assert smol_tokenizer.decode(fresh.ids[-fresh.turn_tokens :]) == question.text + HEADER


def test_full_answers_the_same_reused_and_peers_that_choose_by_the_question_refuse(
    engine, word_model, smol_tokenizer
):
    quiz = reuse.build_quiz(smol_tokenizer, 300, 0, seed=0)
    for spec in ("full", "speed:lcut=4,anchors=bos,deep=turn"):  # lcut = L: full attention
        records = reuse.ask(engine, make_policy(spec, word_model.shape), quiz, 5)
        assert [r["question"] for r in records] == [0, 1, 2, 3]
        for r in records:
            assert r["refused"] is None and r["identical"] is True
            assert r["reused_answer"] == r["fresh_answer"]
            assert r["reused_tokens"] == len(quiz.prompt.ids) == r["document_tokens"]
    shallow = reuse.ask(engine, make_policy("speed:lcut=1,deep=turn", word_model.shape), quiz, 5)
    assert all(r["reused_tokens"] == len(quiz.prompt.ids) for r in shallow)
    for spec in ("snapkv", "fastkv", "specprefill"):
        records = reuse.ask(engine, make_policy(spec, word_model.shape), quiz, 3)
        for r in records:
            assert "cannot serve another prompt" in r["refused"]
            assert r["reused_answer"] is None and r["reused_correct"] is None
            assert isinstance(r["fresh_answer"], str) and r["fresh_correct"] in (True, False)


# -- in the harness -----------------------------------------------------------------------------
def reuse_config(**overrides) -> EvalConfig:
    values = dict(
        model="tiny-words",
        methods=["speed:lcut=2,anchors=bos,deep=turn", "snapkv"],
        tasks=["reuse"],
        lengths=[320],
        n={"reuse": 2},
    )
    return EvalConfig(**(values | overrides))


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.endswith(("seconds", "_s"))} for r in records]


def test_reuse_task_records_summary_tables_and_resume(word_model, tmp_path, monkeypatch):
    result = EvalRunner(word_model, reuse_config(), tmp_path / "a").run(progress=False)
    records = result["records"]
    assert len(records) == 3 * 2 * reuse.QUESTIONS  # methods x documents x questions
    speed = "speed:lcut=2,anchors=bos,deep=turn,selfonly=false"
    snap = "snapkv:retain=0.1,window=32,kernel=5,pool=avg,gqa=false"
    summary = {r["method"]: r for r in result["summary"]}
    assert summary["full"]["identical"] == 1.0 and summary["full"]["documents"] == 2
    assert summary["full"]["n"] == 2 * reuse.QUESTIONS
    assert summary[snap]["reused"] is None and summary[snap]["fresh"] is not None
    assert summary[speed]["reused"] is not None
    assert set(summary["full"]["by_kind"]) == {"number", "city", "name", "date"}
    tables = (tmp_path / "a" / "tables.md").read_text()
    assert f"| `{snap}` | refuses (8) |" in tables
    assert "over one cached document" in tables
    # a kill in the middle of a document's questions: that run is done again on resume
    path = tmp_path / "a" / "records.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-2]))
    resumed = EvalRunner(word_model, reuse_config(), tmp_path / "a").run(
        resume=True, progress=False, plots=False
    )
    assert without_timing(resumed["records"]) == without_timing(records)
    monkeypatch.setattr(EvalRunner, "run_unit", lambda *a: pytest.fail("recomputed a run"))
    again = EvalRunner(word_model, reuse_config(), tmp_path / "a").run(
        resume=True, progress=False, plots=False
    )
    assert again["records"] == resumed["records"]


def test_reuse_refuses_a_document_too_short(word_model, tmp_path):
    with pytest.raises(UserError, match="too short for task reuse"):
        EvalRunner(word_model, reuse_config(lengths=[120]), tmp_path)


def upper_entries(runner: EvalRunner, method: str, prompt) -> int:
    """Cache entries of the top layer when the first token is produced."""
    return runner.generate(method, prompt, 2).layer_lengths[-1]


def test_deep_turn_in_the_harness_is_the_question_turn_or_the_whole_message(
    word_model, smol_tokenizer, tmp_path
):
    """The harness hands the prompt's last turn to the engine: with the question in its own
    turn, the upper layers hold BoS and that turn; in the one-message layout the turn is the
    whole message, document included."""
    turn, one = "speed:lcut=1,anchors=bos,deep=turn", "speed:lcut=1,anchors=bos,deep=1"
    runner = EvalRunner(word_model, reuse_config(methods=[turn, one], tasks=["niah"]), tmp_path)
    turn, one = runner.methods[1:]
    asked = needles.build_sample(smol_tokenizer, "niah", 400, 0, 0, [0.5], own_turn=True)
    question_turn = asked.prompt.turn_tokens
    assert smol_tokenizer.decode(asked.prompt.ids[-question_turn:]) == asked.question + HEADER
    assert upper_entries(runner, turn, asked.prompt) == 1 + question_turn
    assert upper_entries(runner, one, asked.prompt) == 1 + 1  # BoS and the last token
    together = needles.build_sample(smol_tokenizer, "niah", 400, 0, 0, [0.5])
    message = together.prompt.turn_tokens
    assert smol_tokenizer.decode(together.prompt.ids[-message:]).startswith(needles.INTRO_ONE)
    assert message > 300
    assert upper_entries(runner, turn, together.prompt) == 1 + message


def test_question_turn_layout_in_samples_header_and_cli(
    word_model, smol_tokenizer, tmp_path, monkeypatch, capsys
):
    sample = needles.build_sample(smol_tokenizer, "niah", 500, 1, 0, [0.5], own_turn=True)
    text = smol_tokenizer.decode(sample.prompt.ids)
    assert 494 <= len(sample.prompt.ids) <= 500
    assert text.endswith(f"<|im_end|>\n<|im_start|>user\n{sample.question}{HEADER}")
    assert text.index(sample.facts[0]["text"]) < text.index(sample.question)
    same = needles.build_sample(smol_tokenizer, "niah", 500, 1, 0, [0.5])
    assert same.expected == sample.expected and same.facts == sample.facts
    out = tmp_path / "run"
    args = ["eval", "--methods", "speed:lcut=2,anchors=bos,deep=turn", "--tasks", "niah,reuse"]
    args += ["--lengths", "320", "--samples", "1", "--question-turn", "--json", "--out", str(out)]
    code, stdout, _ = run_cli(args, monkeypatch, capsys, model=word_model)
    assert code == 0
    result = json.loads(stdout)
    assert result["header"]["question_turn"] is True and result["config"]["question_turn"]
    assert {(r["task"], r["n"]) for r in result["summary"]} == {("niah", 1), ("reuse", 4)}
    header = json.loads((out / "records.jsonl").read_text().splitlines()[0])["header"]
    assert header["question_turn"] is True
    assert "question_turn" not in EvalRunner(word_model, reuse_config(), tmp_path).header()
