"""RULER through NVIDIA's `nvidia-long-context-eval`: every task generated offline at a short
length, the samples equal to the package's own prepare.py's, seeded, its metric on hand-written
cases, and `speedkv eval --tasks ruler/...` end to end on the real SmolLM2 with --resume."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from speedkv.errors import UserError
from speedkv.evals import ruler
from speedkv.evals.runner import EvalConfig, EvalRunner
from speedkv.evals.tasks import expand_groups, parse_n, parse_tasks
from speedkv.hf.loading import tokenizer_fingerprint

from helpers import RULER_SAMPLES, RULER_SHORT, ruler_length, run_cli

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("long_context_eval", "nltk", "punkt")),
    reason="the speedkv[ruler] extra is not installed",
)

SHORT = RULER_SHORT  # every synthetic task generates here; QA needs 2048
N = RULER_SAMPLES
length_of = ruler_length


def samples(tokenizer, ruler_root: Path, task: str, seed: int = 0) -> list[ruler.RulerSample]:
    return ruler.load_samples(tokenizer, task, length_of(task), seed, N, ruler_root)


def saved(tokenizer, ruler_root: Path, task: str, seed: int = 0) -> Path:
    fingerprint = tokenizer_fingerprint(tokenizer)
    return ruler.sample_file(ruler_root, fingerprint, task, length_of(task), seed, N)


# -- generation -------------------------------------------------------------------------------
@pytest.mark.parametrize("task", ruler.TASKS)
def test_every_task_generates_offline_within_its_length(smol_tokenizer, ruler_root, task):
    spec = ruler.task_spec(task)
    length = length_of(task)
    got = samples(smol_tokenizer, ruler_root, task)
    assert [s.index for s in got] == list(range(N))
    for sample in got:
        own = len(smol_tokenizer.tokenize(sample.input))  # RULER counts text, no template
        if spec.kind == "variable_tracking":
            # RULER counts its few-shot example before re-drawing the example's names
            assert abs(sample.length - (own + spec.tokens_to_generate)) <= 16
        else:
            assert sample.length == own + spec.tokens_to_generate
        # fwe fits its text alone to the length; the others leave room for the answer
        fitted = own if spec.kind == "freq_words_extraction" else sample.length
        assert length // 2 < fitted <= length
        assert sample.outputs and all(o.strip() for o in sample.outputs)
        if spec.kind != "qa":  # the needles, chain names and words are in the text
            assert all(o.lower() in sample.input.lower() for o in sample.outputs)
        # the chat template around RULER's text, the answer prefix opening the reply
        text = smol_tokenizer.decode(sample.prompt.ids)
        assert text.startswith("<|im_start|>system\n")
        assert text.endswith(f"<|im_end|>\n<|im_start|>assistant\n{sample.reply_start}")
        assert sample.input.endswith(" " + sample.reply_start)
        assert sample.input[: -len(sample.reply_start) - 1] in text
        header = smol_tokenizer(sample.reply_start, add_special_tokens=False)["input_ids"]
        assert sample.prompt.header_tokens >= len(header) + 3  # `<|im_start|>assistant\n`


def test_samples_are_saved_once_and_reused(smol_tokenizer, ruler_root):
    path = saved(smol_tokenizer, ruler_root, "ruler/cwe")
    before = path.stat().st_mtime_ns
    ruler.ensure_samples(smol_tokenizer, [("ruler/cwe", SHORT, N)], 0, ruler_root)
    assert path.stat().st_mtime_ns == before
    assert [json.loads(line)["index"] for line in path.read_text().splitlines()] == [0, 1]


def test_samples_are_what_rulers_prepare_makes_and_follow_the_seed(
    smol_tokenizer, ruler_root, tmp_path
):
    """The package's own prepare.py (seed 42) writes the same bytes as our seed 0, for the task
    that needs the offline punkt data; another seed gives other samples."""
    package = Path(ruler.package_file("data"))
    tokenizer_dir = ruler_root / "tokenizers" / tokenizer_fingerprint(smol_tokenizer)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # its `python`
        "NLTK_DATA": str(ruler_root / "nltk_data"),
        "HF_HUB_OFFLINE": "1",
    }
    prepare = [sys.executable, str(package / "prepare.py"), "--save_dir", str(tmp_path)]
    prepare += ["--task", "niah_single_2", "--tokenizer_path", str(tokenizer_dir)]
    prepare += ["--tokenizer_type", "hf", "--max_seq_length", str(SHORT), "--num_samples", str(N)]
    theirs = subprocess.Popen(prepare, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    # meanwhile another seed, of a task whose generator starts in seconds (niah's sorts 6.2M
    # words first)
    ruler.ensure_samples(smol_tokenizer, [("ruler/vt", length_of("ruler/vt"), N)], 1, ruler_root)
    assert theirs.wait(timeout=300) == 0, theirs.stderr.read()
    ours = saved(smol_tokenizer, ruler_root, "ruler/niah_single_2").read_bytes()
    assert (tmp_path / "niah_single_2" / "validation.jsonl").read_bytes() == ours
    other = samples(smol_tokenizer, ruler_root, "ruler/vt", seed=1)
    mine = samples(smol_tokenizer, ruler_root, "ruler/vt")
    assert [s.outputs for s in other] != [s.outputs for s in mine]
    assert all(a.input != b.input for a, b in zip(other, mine))


def test_punkt_route_gives_nltk_its_english_tables(ruler_root):
    import nltk
    from nltk.tokenize import sent_tokenize

    nltk_dir = ruler.punkt_data(ruler_root)
    assert sorted(p.name for p in (nltk_dir / "tokenizers/punkt_tab/english").iterdir()) == [
        "abbrev_types.txt", "collocations.tab", "ortho_context.tab", "sent_starters.txt",
    ]  # fmt: skip
    nltk.data.path.insert(0, str(nltk_dir))
    try:
        text = "Mr. Smith met Dr. Jones at 5 p.m. in Washington. They talked. It rained."
        assert sent_tokenize(text) == [
            "Mr. Smith met Dr. Jones at 5 p.m. in Washington.", "They talked.", "It rained.",
        ]  # fmt: skip
    finally:
        nltk.data.path.remove(str(nltk_dir))


# -- scoring ----------------------------------------------------------------------------------
def test_each_task_uses_rulers_metric():
    part = {"ruler/qa_1", "ruler/qa_2"}
    for task in ruler.TASKS:
        expected = "string_match_part" if task in part else "string_match_all"
        assert ruler.task_spec(task).metric == expected, task


def test_string_match_all_gives_the_share_of_references_found():
    refs = ["1234567", "7654321", "1111111", "2222222"]
    assert ruler.score("ruler/niah_multivalue", "1234567, 7654321, 1111111 and 2222222", refs) == 1
    assert ruler.score("ruler/niah_multivalue", "They are 7654321 and 2222222.", refs) == 0.5
    assert ruler.score("ruler/niah_multivalue", "I do not know.", refs) == 0
    # case ignored; containment, as RULER defines it (not whole words)
    assert ruler.score("ruler/vt", "abcde, FGHIJxyz", ["ABCDE", "FGHIJ"]) == 1
    assert ruler.score("ruler/cwe", "1. apple 2. pear", ["apple", "plum", "pear", "fig"]) == 0.5


def test_string_match_part_needs_any_reference():
    refs = ["10th and 11th centuries", "in the 10th and 11th centuries"]
    assert ruler.score("ruler/qa_1", "In the 10th and 11th centuries.", refs) == 1
    assert ruler.score("ruler/qa_1", "the 10th century", refs) == 0
    assert ruler.score("ruler/qa_2", " Chief of\x07Protocol ", ["chief of\nprotocol"]) == 1


def test_split_reply_finds_the_answer_prefix():
    spec = ruler.task_spec("ruler/niah_single_1")
    text = "Some text.\nWhat is the special magic number for x-y mentioned in the provided text?"
    prefix = " The special magic number for x-y mentioned in the provided text is"
    assert ruler.split_reply(text + prefix, spec.answer_prefix) == (text, prefix)
    with pytest.raises(ValueError):
        ruler.split_reply(text, spec.answer_prefix)


def query_of(sample: ruler.RulerSample, context: str) -> str | None:
    """The sample's query found from its context and references, not from its question: the
    key of the needles holding the values (niah), the number the chain starts from (vt)."""
    spec = ruler.task_spec(sample.task)
    if spec.kind == "niah":
        keys = [
            re.search(rf"for (\S+) is: {re.escape(value)}", context).group(1)
            for value in sample.outputs
        ]
        return " ".join(dict.fromkeys(keys))
    if spec.kind == "variable_tracking":
        return re.search(rf"VAR {sample.outputs[0]} = (\d+)", context).group(1)
    return None


@pytest.mark.parametrize("task", ruler.TASKS)
def test_a_sample_splits_into_context_question_and_answer_prefix(smol_tokenizer, ruler_root, task):
    """What a query-agnostic cache compresses (the context) and what comes after it, for
    kvpress's pipeline (benchmarks/kvpress_peer.py): the question as the template words it."""
    spec = ruler.task_spec(task)
    for sample in samples(smol_tokenizer, ruler_root, task):
        context, question, prefix = ruler.split_question(sample.input, spec)
        assert context + question + prefix == sample.input
        assert prefix.lstrip() == sample.reply_start
        assert question.startswith("\n") and not question.endswith(" ")
        assert len(question) <= 300 and 5 * len(question) < len(context)
        query = query_of(sample, context)
        if query is not None:
            assert all(key in question for key in query.split())
        elif spec.kind == "qa":  # the question asked of the documents
            assert re.fullmatch(r"\n\nAnswer the question .*\n\nQuestion: \S.*", question, re.S)
        else:  # cwe and fwe ask a fixed question
            assert question == ruler.question_tail(spec)
        # the split falls on a token boundary: the two parts tokenise to the input's tokens
        parts = [smol_tokenizer.encode(p, add_special_tokens=False) for p in (context, question)]
        whole = smol_tokenizer.encode(context + question, add_special_tokens=False)
        assert parts[0] + parts[1] == whole


def test_question_start_refuses_an_input_without_the_question():
    spec = ruler.task_spec("ruler/vt")
    with pytest.raises(ValueError, match="no question"):
        ruler.question_start("Memorize this.\n\nVAR A = 1\nQuestion: x\nmore", spec)
    with pytest.raises(ValueError, match="no question"):  # within the template's opening
        ruler.question_start("Memorize.\nQuestion: Find all of it.", spec)
    text = "Memorize and track the chain(s) of variable assignment.\n\n" + "VAR A = 1. " * 4
    assert ruler.question_start(text + "\nQuestion: Find all of it.", spec) == len(text)


# -- options ----------------------------------------------------------------------------------
def test_ruler_names_a_group_and_its_counts():
    assert parse_tasks("niah,ruler") == ["niah", *ruler.TASKS]
    assert parse_tasks("ruler/vt,vt") == ["ruler/vt", "vt"]  # RULER's vt is not ours
    counts = parse_n("ruler=3,ruler/cwe=5", ["niah", *ruler.TASKS])
    assert counts["niah"] == 10 and counts["ruler/vt"] == 3 and counts["ruler/cwe"] == 5
    with pytest.raises(UserError, match="unknown task 'ruler/vt2'"):
        parse_tasks("ruler/vt2")


def test_python_config_takes_the_group_too():
    config = EvalConfig(
        model="m", methods=["full"], tasks=["niah", "ruler"], lengths=[4096],
        n={"niah": 1, "ruler": 2, "ruler/cwe": 3},
    )  # fmt: skip
    expanded = expand_groups(config)
    assert expanded.tasks == ["niah", *ruler.TASKS]
    assert expanded.n == {"niah": 1, **{t: 3 if t == "ruler/cwe" else 2 for t in ruler.TASKS}}


def test_qa_below_its_shortest_length_is_refused(word_model, tmp_path):
    config = EvalConfig(
        model="tiny-words", methods=["full"], tasks=["ruler/qa_1"], lengths=[1024],
        n={"ruler/qa_1": 1},
    )  # fmt: skip
    with pytest.raises(UserError, match="too short for task ruler/qa_1: .* at least 2048"):
        EvalRunner(word_model, config, tmp_path)


def test_a_prompt_and_answer_over_the_context_is_refused_with_a_length_that_fits(
    word_model, ruler_root, tmp_path
):
    """fwe fits its text alone to the length, so at the model's whole context (1024 here) its
    longest prompt, with the chat template and 50 new tokens, does not fit: refused before any
    work, naming each such task and a length that leaves room (vt's prompts fit)."""
    tasks = ["ruler/fwe", "ruler/vt"]
    config = EvalConfig(
        model="tiny-words", methods=["full"], tasks=tasks, lengths=[SHORT],
        n=dict.fromkeys(tasks, N), ruler_data=str(ruler_root),
    )  # fmt: skip
    with pytest.raises(UserError) as refused:
        EvalRunner(word_model, config, tmp_path).run(progress=False, plots=False)
    message = str(refused.value)
    assert re.search(rf"ruler/fwe at {SHORT} \((\d+) tokens with its answer\)", message)
    assert "ruler/vt" not in message
    assert f"--lengths {SHORT - ruler.longest_answer()}" in message
    written = [
        line for f in tmp_path.glob("**/records.jsonl") for line in f.read_text().splitlines()
    ]
    assert not [line for line in written if '"method"' in line]  # no sample was answered


# -- end to end -------------------------------------------------------------------------------
def test_eval_runs_ruler_resumes_and_reports(word_model, ruler_root, tmp_path, monkeypatch, capsys):
    """The CLI on a tiny model with SmolLM2's tokenizer and chat template (the real model's
    answers are checked below): full first, then SPEED added with --resume."""
    out = tmp_path / "run"
    args = ["eval", "--tasks", "ruler/niah_single_1,ruler/vt", "--lengths", str(SHORT)]
    args += ["--samples", str(N), "--ruler-data", str(ruler_root), "--out", str(out), "--json"]
    code, stdout, stderr = run_cli([*args, "--methods", "full"], monkeypatch, capsys, word_model)
    assert code == 0, stderr
    first = json.loads(stdout)["records"]
    assert len(first) == 4 and {r["method"] for r in first} == {"full"}

    speed = "speed:lcut=2,anchors=bos,deep=1"
    code, stdout, stderr = run_cli(
        [*args, "--methods", f"full;{speed}", "--resume"], monkeypatch, capsys, word_model
    )
    assert code == 0, stderr
    assert "4 runs to do (4 already recorded)" in stderr
    result = json.loads(stdout)
    records = result["records"]
    assert [r for r in records if r["method"] == "full"] == first  # kept, not run again
    mine = [r for r in records if r["method"] != "full"]
    assert len(mine) == 4 and all(r["method"].startswith("speed:lcut=2,") for r in mine)
    fulls = {(r["task"], r["sample"]): r for r in first}
    for r in mine:
        full = fulls[(r["task"], r["sample"])]
        assert r["input_sha"] == full["input_sha"] and r["prompt_tokens"] == full["prompt_tokens"]
        # the upper 2 of 4 layers keep only the anchor and the answer's tokens
        assert 0.5 < r["kv_ratio"] < 0.6
        assert r["kv_ratio"] == pytest.approx(r["kv_bytes"] / full["kv_bytes"])
        assert r["ttft_ratio"] == pytest.approx(r["ttft_s"] / full["ttft_s"])
    for r in records:
        assert r["score"] == ruler.score(r["task"], r["answer"], r["references"])
        assert r["id"] == r["sample"] and r["ruler_length"] <= SHORT
    averages = [r for r in result["summary"] if r["task"] == "ruler"]
    assert [(a["method"], a["tasks"], a["n"]) for a in averages] == [
        ("full", 2, 4), (result["methods"][1], 2, 4),
    ]  # fmt: skip
    for average in averages:
        tasks = [r for r in result["summary"] if r["method"] == average["method"]]
        scores = [r["score"] for r in tasks if r["task"] != "ruler"]
        assert average["score"] == pytest.approx(sum(scores) / 2)

    code, page, _ = run_cli(["eval-report", str(out)], monkeypatch, capsys)
    assert code == 0
    assert "## RULER: " in page and "| method | niah_single_1 | vt | average |" in page
    full_avg = averages[0]
    section = page.split("## RULER: ")[1].splitlines()
    row = next(line for line in section if line.startswith("| `full` | "))
    assert row.endswith(f"| {100 * full_avg['score']:.1f} | 1.000 | 1.00 |")
    assert "| method | RULER avg 1K |" in page  # the overview shows the average only


@pytest.mark.real_model
def test_smollm2_finds_rulers_single_needle(smollm2, ruler_root, tmp_path):
    config = EvalConfig(
        model="smollm2-135m", methods=["full"], tasks=["ruler/niah_single_1"], lengths=[SHORT],
        n={"ruler/niah_single_1": N}, ruler_data=str(ruler_root),
    )  # fmt: skip
    result = EvalRunner(smollm2, config, tmp_path).run(progress=False, plots=False)
    records = result["records"]
    assert [r["score"] for r in records] == [1.0, 1.0], [r["answer"] for r in records]
    assert all(r["references"][0] in r["answer"] for r in records)
