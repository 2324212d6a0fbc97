"""`speedkv eval`: prompt construction, scoring, fidelity against the dense SPEED reference,
the runner's records, resume and determinism, the report, and the CLI's errors."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from speedkv.analysis.dense import speed_dense_forward
from speedkv.core.engine import Engine, Request
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.errors import UserError
from speedkv.evals import fidelity, needles, sanity
from speedkv.evals.documents import Fact, plant_all
from speedkv.evals.report import metric_table, misses_markdown, percent, results_markdown, summarise
from speedkv.evals.runner import EvalConfig, EvalRunner
from speedkv.evals.tasks import DEFAULT_N, parse_depths, parse_n, parse_tasks
from speedkv.hf.loading import LoadedModel
from speedkv.hf.text import encode_prompt
from speedkv.prompts.haystack import essays, sentences, split_names

from conftest import random_prompt
from helpers import run_cli

# tiny models are latency-bound: one thread avoids contention on a shared CPU
pytestmark = pytest.mark.usefixtures("one_thread")

DEPTHS = [0.1, 0.5, 0.9]


@pytest.fixture(scope="module")
def tokenizer(smol_tokenizer):
    """SmolLM2's tokenizer and chat template (no weights loaded)."""
    return smol_tokenizer


# -- prompts --------------------------------------------------------------------------------
@pytest.mark.parametrize("task", needles.NEEDLE_TASKS)
def test_needle_prompt_hits_its_length_with_facts_before_the_question(tokenizer, task):
    sample = needles.build_sample(tokenizer, task, 700, 2, seed=5, depths=DEPTHS)
    assert 700 - 6 <= len(sample.prompt.ids) <= 700
    text = tokenizer.decode(sample.prompt.ids)
    question_at = text.index(sample.question)
    for fact in sample.facts:
        assert 0 < text.index(fact["text"]) < question_at
    assert text.endswith(f"{sample.question}<|im_end|>\n<|im_start|>assistant\n")
    assert sample.depth == DEPTHS[2] == sample.facts[0]["depth"]
    counts = {"niah": 1, "niah_multikey": 1, "niah_multivalue": 4, "vt": 3}
    assert len(sample.expected) == counts[task]
    if task == "vt":  # the chain is planted in order: head first
        positions = [text.index(f["text"]) for f in sample.facts]
        assert positions == sorted(positions)
        assert sample.facts[0]["text"].startswith(f"VAR {sample.expected[0]} = ")


def test_samples_follow_the_seed_and_keep_needles_across_lengths(tokenizer):
    a = needles.build_sample(tokenizer, "niah_multikey", 600, 1, seed=3, depths=DEPTHS)
    again = needles.build_sample(tokenizer, "niah_multikey", 600, 1, seed=3, depths=DEPTHS)
    longer = needles.build_sample(tokenizer, "niah_multikey", 900, 1, seed=3, depths=DEPTHS)
    other = needles.build_sample(tokenizer, "niah_multikey", 600, 1, seed=4, depths=DEPTHS)
    assert a.prompt.ids == again.prompt.ids
    assert (a.expected, a.start, a.facts) == (longer.expected, longer.start, longer.facts)
    assert a.expected != other.expected and a.prompt.ids != other.prompt.ids


def test_a_needle_prompt_longer_than_the_eval_split_reads_it_again(tokenizer):
    sample = needles.build_sample(tokenizer, "niah", 32704, 0, seed=0, depths=[0.5])
    assert 32704 - 6 <= len(sample.prompt.ids) <= 32704  # the split holds about 20K tokens
    text = tokenizer.decode(sample.prompt.ids)
    assert text.count(sample.facts[0]["text"]) == 1  # the essays repeat, the needle does not


def test_haystack_comes_from_the_eval_split(tokenizer):
    sample = needles.build_sample(tokenizer, "niah", 800, 0, seed=0, depths=DEPTHS)
    eval_text = " ".join(essays()[n] for n in split_names("eval"))
    other_text = " ".join(essays()[n] for n in split_names("train") + split_names("calib"))
    text = tokenizer.decode(sample.prompt.ids)
    document = text.split(needles.INTRO_ONE, 1)[1].split(sample.question)[0]
    inner = [s for s in sentences(document)[1:-1] if len(s) > 40 and "pass key" not in s]
    assert len(inner) > 5
    assert all(s in eval_text for s in inner)
    assert not any(s in other_text for s in inner)


def test_plant_all_keeps_order_at_the_same_depth():
    text = "One. Two. Three. Four."
    planted = plant_all(text, [Fact("A.", 0.5), Fact("B.", 0.5), Fact("C.", 1.0)])
    assert planted == "One. Two. A. B. Three. Four. C."
    assert plant_all("", [Fact("A.", 0.3)]) == "A."


def test_too_short_a_length_is_refused(tokenizer):
    with pytest.raises(UserError, match="length 60 is too short for task niah"):
        needles.build_sample(tokenizer, "niah", 60, 0, seed=0, depths=DEPTHS)


# -- scoring --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "answer, expected, found",
    [
        ("The pass key is 60494.", ["60494"], ["60494"]),
        ("The pass key is 60,494!", ["60494"], ["60494"]),
        ("It is 604945.", ["60494"], []),
        ("The pass key is 6049.", ["60494"], []),
        ("1. 111\n2. 222 and 333", ["111", "333", "444"], ["111", "333"]),
        ("They are: abcde, VAR FGHIJ = x", ["ABCDE", "FGHIJ", "KLMNO"], ["ABCDE", "FGHIJ"]),
        ("XABCDE", ["ABCDE"], []),
        ("It is held on the 14th of march.", ["March", "14"], ["March", "14"]),
        ("On March 4.", ["March", "14"], ["March"]),
        ("Oslo's twin, Osloville", ["Oslo"], ["Oslo"]),
    ],
)
def test_found_values(answer, expected, found):
    """Numbers match as whole numbers, words as whole words (case ignored)."""
    assert needles.found_values(answer, expected) == found


def test_token_agreement():
    assert sanity.token_agreement([1, 2, 3], [1, 2, 3]) == 1.0
    assert sanity.token_agreement([1, 9, 3, 4], [1, 2, 3]) == 0.5  # 2 of 4 positions
    assert sanity.token_agreement(list(range(40)), list(range(40))[:-1] + [0]) == 1.0
    assert sanity.token_agreement([], []) == 1.0


# -- fidelity -------------------------------------------------------------------------------
def test_full_against_itself_is_exactly_unchanged(tiny_engine):
    prompt, continuation = random_prompt(40, seed=3), random_prompt(6, seed=4)
    full = fidelity.teacher_forced_logprobs(
        tiny_engine, prompt, continuation, make_policy("full", tiny_engine.shape)
    )
    metrics = fidelity.compare(full, full, continuation)
    assert metrics["agreement"] == 1.0 and metrics["kl"] == 0.0
    assert metrics["nll"] == metrics["nll_full"] and metrics["first_disagreement"] is None


@pytest.mark.parametrize("anchors, count", [("bos", 1), ("none", 0)])
def test_teacher_forcing_equals_dense_speed(tiny_engine, anchors, count):
    """The decode path's log-probs at every continuation position equal SPEED computed
    densely by transformers' own layers."""
    prompt, continuation = random_prompt(37, seed=5), random_prompt(5, seed=6)
    policy = make_policy(f"speed:lcut=2,anchors={anchors},deep=1", tiny_engine.shape)
    ours = fidelity.teacher_forced_logprobs(tiny_engine, prompt, continuation, policy)
    ids = torch.tensor(prompt + continuation)
    logits, positions = speed_dense_forward(tiny_engine.backbone, ids, len(prompt), 2, count)
    rows = (positions >= len(prompt) - 1) & (positions < len(prompt) + len(continuation) - 1)
    dense = torch.log_softmax(logits[rows], dim=-1)
    assert ours.shape == dense.shape == (5, tiny_engine.shape.vocab_size)
    torch.testing.assert_close(ours, dense, atol=1e-4, rtol=0)
    full = fidelity.teacher_forced_logprobs(
        tiny_engine, prompt, continuation, make_policy("full", tiny_engine.shape)
    )
    metrics = fidelity.compare(ours, full, continuation)
    kl = (full.exp() * (full - dense)).sum(-1).mean()
    assert metrics["kl"] == pytest.approx(float(kl), abs=1e-5) and metrics["kl"] > 0


def test_fidelity_sample_is_a_passage_and_its_continuation(tokenizer):
    sample = fidelity.build_sample(tokenizer, 300, 16, index=1, seed=0)
    assert len(sample.prompt) == 300 and len(sample.continuation) == 16
    text = tokenizer.decode(sample.prompt + sample.continuation)
    eval_text = " ".join(essays()[n] for n in split_names("eval"))
    assert text[20:200] in eval_text


# -- the runner ------------------------------------------------------------------------------
METHODS = ["full", "speed:lcut=1,anchors=bos,deep=1", "speed:lcut=4,deep=1"]
TASKS = ["niah", "niah_multikey", "niah_multivalue", "vt", "fidelity", "sanity"]


def small_config(**overrides) -> EvalConfig:
    values = dict(
        model="tiny-words",
        methods=METHODS,
        tasks=TASKS,
        lengths=[420],
        n={t: 1 for t in TASKS} | {"niah": 2, "sanity": 2},
        fidelity_tokens=6,
    )
    return EvalConfig(**(values | overrides))


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]


def test_runner_records_summary_and_files(word_model, tmp_path):
    result = EvalRunner(word_model, small_config(), tmp_path).run(progress=False)
    records = result["records"]
    assert len(records) == 3 * (2 + 1 + 1 + 1 + 1 + 2)
    assert result["methods"][1] == "speed:lcut=1,anchors=bos,deep=1,selfonly=false"
    summary = {(r["task"], r["method"], r["length"]): r for r in result["summary"]}
    for row in result["summary"]:
        assert {"method", "task", "length", "score", "n"} <= set(row)
    full_fid = summary[("fidelity", "full", 420)]
    assert (full_fid["ppl_ratio"], full_fid["agreement"], full_fid["kl"]) == (1.0, 1.0, 0.0)
    assert summary[("sanity", "full", 0)]["score"] == 1.0
    # lcut = L is full attention: same answers, same distributions
    same = "speed:lcut=4,anchors=bos,deep=1,selfonly=false"
    assert summary[("fidelity", same, 420)]["agreement"] == 1.0
    assert summary[("fidelity", same, 420)]["kl"] < 1e-6
    assert summary[("sanity", same, 0)]["score"] == 1.0
    niah = [r for r in records if r["task"] == "niah"]
    for key in ("prompt_tokens", "depth", "expected", "answer", "found", "correct", "facts"):
        assert key in niah[0]
    assert [r["depth"] for r in niah if r["method"] == "full"] == [0.1, 0.5]
    for name in ("results.json", "records.jsonl", "tables.md", "fidelity.png"):
        assert (tmp_path / name).is_file()
    assert (tmp_path / "heatmap_full.png").is_file()
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["summary"] == result["summary"]
    assert "torch" in saved["versions"] and saved["config"]["seed"] == 0


def test_resume_and_rerun_give_the_same_records(word_model, tmp_path, monkeypatch):
    tasks = ["niah", "fidelity", "sanity"]
    config = small_config(methods=METHODS[:2], tasks=tasks, n={t: 1 for t in tasks})
    first = EvalRunner(word_model, config, tmp_path / "a").run(progress=False, plots=False)
    again = EvalRunner(word_model, config, tmp_path / "b").run(progress=False, plots=False)
    assert without_timing(first["records"]) == without_timing(again["records"])
    assert first["summary"] == again["summary"]
    # an interrupted sweep: the header, 3 records and a cut line; then resume
    path = tmp_path / "b" / "records.jsonl"
    kept = "".join(path.read_text().splitlines(keepends=True)[:4])
    path.write_text(kept + '{"method": "full", "task": "ni')  # killed while writing
    resumed = EvalRunner(word_model, config, tmp_path / "b").run(
        resume=True, progress=False, plots=False
    )
    assert without_timing(resumed["records"]) == without_timing(first["records"])
    # nothing left to do: no sample is built, no method runs
    monkeypatch.setattr(EvalRunner, "run_unit", lambda *a: pytest.fail("recomputed a run"))
    done = EvalRunner(word_model, config, tmp_path / "b").run(
        resume=True, progress=False, plots=False
    )
    assert done["records"] == resumed["records"]


def test_shared_prefill_gives_the_answers_of_separate_runs(word_model, tmp_path):
    methods = [
        "speed:lcut=1,anchors=bos,deep=1",
        "speed:lcut=2,anchors=sink:4,deep=3",
        "speed:lcut=1,anchors=none,selfonly=true,deep=1",  # runs its own prefill
        "snapkv",  # not SPEED: its own prefill
    ]
    config = small_config(methods=methods, tasks=["niah"], n={"niah": 2})
    alone = EvalRunner(word_model, config, tmp_path / "a").run(progress=False, plots=False)
    config.shared_prefill = True
    runner = EvalRunner(word_model, config, tmp_path / "b")
    shared = runner.run(progress=False, plots=False)
    answers = [(r["method"], r["sample"], r["answer"]) for r in alone["records"]]
    assert [(r["method"], r["sample"], r["answer"]) for r in shared["records"]] == answers
    assert shared["header"]["shared_prefill"] is True
    prompt = needles.build_sample(word_model.tokenizer, "niah", 420, 0, 0, [0.5]).prompt
    prefixes, share_s = runner.shared_prefixes(prompt, runner.methods)
    assert sorted(prefixes) == sorted(runner.methods[:3]) and share_s > 0


def test_resume_refuses_other_settings(word_model, tmp_path):
    config = small_config(tasks=["sanity"], n={"sanity": 1})
    EvalRunner(word_model, config, tmp_path).run(progress=False, plots=False)
    with pytest.raises(UserError, match="was made with other settings"):
        EvalRunner(
            word_model, small_config(tasks=["sanity"], n={"sanity": 1}, seed=1), tmp_path
        ).run(resume=True, progress=False)


def test_sanity_calib_split_has_its_own_prompts(word_model, tmp_path):
    assert not set(sanity.PROMPTS) & set(sanity.CALIB_PROMPTS)
    n = len(sanity.CALIB_PROMPTS) + 5  # asking for more than a split has gives all of it
    config = small_config(tasks=["sanity"], n={"sanity": n}, split="calib", methods=["full"])
    records = EvalRunner(word_model, config, tmp_path).run(progress=False, plots=False)["records"]
    assert [r["prompt"] for r in records] == list(sanity.CALIB_PROMPTS)


def nudged(model: LoadedModel, name: str) -> LoadedModel:
    """Another model with the same tokenizer: `model`'s weights plus a little noise."""
    torch.manual_seed(1)
    hf = copy.deepcopy(model.hf_model)
    for weight in hf.parameters():
        weight.add_(0.05 * torch.randn_like(weight))
    return LoadedModel(name=name, hf_model=hf, tokenizer=model.tokenizer, source="memory")


def test_reference_model_is_what_fidelity_and_sanity_compare_with(word_model, tmp_path):
    tasks = ["fidelity", "sanity"]
    other = nudged(word_model, "tiny-words-tuned")
    config = small_config(tasks=tasks, n={t: 2 for t in tasks}, reference=other.name)
    result = EvalRunner(word_model, config, tmp_path / "ref", other).run(
        progress=False, plots=False
    )
    assert result["header"]["reference"] == other.name
    sample = fidelity.build_sample(word_model.tokenizer, 420, 6, 0, 0)
    full = make_policy("full", word_model.shape)

    def logprobs(model, spec):
        engine = Engine(model)
        policy = make_policy(spec, model.shape)
        return fidelity.teacher_forced_logprobs(engine, sample.prompt, sample.continuation, policy)

    theirs = logprobs(other, "full")
    for method in result["methods"]:
        record = next(
            r
            for r in result["records"]
            if (r["task"], r["sample"], r["method"]) == ("fidelity", 0, method)
        )
        expected = fidelity.compare(logprobs(word_model, method), theirs, sample.continuation)
        assert record["agreement"] == expected["agreement"]
        assert record["kl"] == pytest.approx(expected["kl"], abs=1e-6)
        assert record["nll_full"] == pytest.approx(expected["nll_full"], abs=1e-6)
    full_fidelity = [
        r for r in result["records"] if r["task"] == "fidelity" and r["method"] == "full"
    ]
    assert any(r["kl"] > 1e-4 for r in full_fidelity)  # its own full is no longer the yardstick
    prompt = encode_prompt(word_model.tokenizer, sanity.PROMPTS[1])
    request = Request(prompt.ids, full, SamplingParams(max_new_tokens=sanity.MAX_NEW_TOKENS))
    answer = Engine(other).generate([request])[0]
    for record in (r for r in result["records"] if r["task"] == "sanity" and r["sample"] == 1):
        assert record["full_answer"] == answer.text
        assert record["exact"] == (record["output_ids"] == answer.output_ids)
    # the model as its own reference is the default comparison, record for record
    config.reference = word_model.name
    itself = EvalRunner(word_model, config, tmp_path / "self", word_model)
    config_plain = small_config(tasks=tasks, n={t: 2 for t in tasks})
    plain = EvalRunner(word_model, config_plain, tmp_path / "plain")
    assert without_timing(itself.run(progress=False, plots=False)["records"]) == without_timing(
        plain.run(progress=False, plots=False)["records"]
    )
    # a run against a reference does not resume as one without it
    with pytest.raises(UserError, match="was made with other settings"):
        EvalRunner(word_model, config_plain, tmp_path / "ref").run(resume=True, progress=False)


def test_reference_model_must_share_the_tokenizer(word_model, tmp_path):
    untokenized = LoadedModel(
        name="bare", hf_model=word_model.hf_model, tokenizer=None, source="memory"
    )
    with pytest.raises(UserError, match="does not share tiny-words's tokenizer"):
        EvalRunner(word_model, small_config(reference="bare"), tmp_path, untokenized)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(lengths=[2048]), "longer than the model's context of 1024"),
        (dict(lengths=[100]), "length 100 is too short for task niah"),
        (dict(tasks=["fidelity"], lengths=[1020]), "leaves no room for task fidelity"),
        (dict(n={t: 0 for t in TASKS}), "at least 1 sample"),
        (dict(methods=["speed:lcut=9"]), "lcut must be between 0 and 4"),
        (dict(depths=[1.5]), "depths must be fractions"),
    ],
)
def test_runner_validates(word_model, tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        EvalRunner(word_model, small_config(**overrides), tmp_path)


# -- options and report ------------------------------------------------------------------------
def test_option_parsing():
    assert parse_tasks("niah, vt,niah") == ["niah", "vt"]
    assert parse_n(None, ["niah", "vt"]) == {"niah": DEFAULT_N["niah"], "vt": DEFAULT_N["vt"]}
    assert parse_n("3", ["niah", "vt"]) == {"niah": 3, "vt": 3}
    assert parse_n("vt=2,fidelity=9", ["niah", "vt"]) == {"niah": DEFAULT_N["niah"], "vt": 2}
    assert parse_depths("0.9,0.1,0.1") == [0.1, 0.9]
    for bad, call in [
        ("nosuch", lambda: parse_tasks("niah,nosuch")),
        ("at least 1", lambda: parse_n("0", ["niah"])),
        ("task=count", lambda: parse_n("bogus=2", ["niah"])),
        ("whole number", lambda: parse_n("two", ["niah"])),
    ]:
        with pytest.raises(UserError, match=bad):
            call()


def test_summary_and_markdown_table():
    records = [
        {"method": m, "task": "niah", "length": n, "sample": i, "score": s, "recall": s,
         "depth": d, "prompt_tokens": n}
        for m, n, i, s, d in [
            ("full", 2048, 0, 1.0, 0.1), ("full", 2048, 1, 1.0, 0.5),
            ("full", 4096, 0, 1.0, 0.1), ("speed", 2048, 0, 0.0, 0.1),
            ("speed", 2048, 1, 1.0, 0.5),
        ]
    ]  # fmt: skip
    summary = summarise(records, ["full", "speed"], ["niah"])
    assert [(r["method"], r["length"], r["score"], r["n"]) for r in summary] == [
        ("full", 2048, 1.0, 2),
        ("full", 4096, 1.0, 1),
        ("speed", 2048, 0.5, 2),
    ]
    assert summary[2]["by_depth"] == {"0.1": 0.0, "0.5": 1.0}
    assert metric_table(summary, "niah", "score", percent) == (
        "| method | 2K | 4K |\n|---|---:|---:|\n"
        "| `full` | 100% (2) | 100% (1) |\n| `speed` | 50% (2) | – |\n"
    )


# -- the command line -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", "niah,bogus"], "unknown task 'bogus'"),
        (["--methods", "speed:lcut"], "malformed method spec"),
        (["--methods", "nosuch"], "unknown method 'nosuch'"),
        (["--samples", "0"], "--samples must be at least 1"),
        (["--lengths", "4096"], "longer than the model's context of 1024"),
        (["--lengths", "128"], "too short for task niah"),
        (["--depths", "0.5,2"], "depths must be fractions"),
        (["--split", "train"], "split must be eval or calib"),
        (["--continuation-tokens", "0"], "continuation-tokens must be at least 1"),
    ],
)
def test_bad_arguments_exit_2_with_one_sentence(args, message, word_model, monkeypatch, capsys):
    base = ["eval", "--methods", "full;speed:lcut=2,deep=1"]
    code, _, err = run_cli([*base, *args], monkeypatch, capsys, model=word_model)
    assert code == 2
    assert message in err and "Traceback" not in err
    assert [line for line in err.splitlines() if not line.startswith(("[eval]", "[speedkv]"))] == [
        line for line in err.splitlines() if line.startswith("error:")
    ]


def test_eval_json_and_report(word_model, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    args = [
        "eval",
        "--methods",
        "speed:lcut=2,deep=1",
        "--tasks",
        "niah,sanity",
        "--lengths",
        "300",
    ]
    args += ["--samples", "1", "--json"]
    code, stdout, _ = run_cli([*args, "--out", str(out)], monkeypatch, capsys, model=word_model)
    assert code == 0
    result = json.loads(stdout)
    speed = "speed:lcut=2,anchors=bos,deep=1,selfonly=false"
    assert [(r["task"], r["method"]) for r in result["summary"]] == [
        ("niah", "full"),
        ("niah", speed),
        ("sanity", "full"),
        ("sanity", speed),
    ]
    code, page, _ = run_cli(
        ["eval-report", str(out), "--command", "make results"], monkeypatch, capsys
    )
    assert code == 0
    assert page.startswith("# Quality results") and "make results" in page
    assert "## niah: single needle" in page and "| `full` | 100% (1) |" in page
    findings = tmp_path / "findings.md"
    findings.write_text("## What the numbers say\n\nSPEED keeps the needle.\n")
    code, page, _ = run_cli(
        ["eval-report", str(out), "--findings", str(findings)], monkeypatch, capsys
    )
    assert code == 0
    assert page.index("## Overview") < page.index("SPEED keeps the needle.")
    assert page.index("SPEED keeps the needle.") < page.index("## How the tasks are built")
    docs = tmp_path / "docs" / "results.md"
    code, stdout, _ = run_cli(
        ["eval-report", str(out), "--findings", str(findings), "--page", str(docs)],
        monkeypatch,
        capsys,
    )
    assert code == 0 and stdout == ""
    written = docs.read_text()
    assert "SPEED keeps the needle." in written
    assert "](results/overview.png)" in written  # the run made no fidelity plot: not linked
    assert "fidelity.png)" not in written
    assert (docs.parent / "results" / "overview.png").stat().st_size > 10_000
    code, _, err = run_cli(["eval-report", str(tmp_path / "none")], monkeypatch, capsys)
    assert code == 2 and "does not exist" in err
    code, _, err = run_cli(
        ["eval-report", str(out), "--findings", str(tmp_path / "nope.md")], monkeypatch, capsys
    )
    assert code == 2 and "findings file" in err
    code, _, err = run_cli(["eval-report", str(out), "--page", str(tmp_path)], monkeypatch, capsys)
    assert code == 2 and "ending in .md" in err


def test_eval_report_compares_several_runs_in_one_table(word_model, tmp_path, monkeypatch, capsys):
    """Several directories: a row per run and method, fidelity as perplexity, its ratio and
    top-1 agreement, each run's reference named under the table."""
    outs = []
    for name, methods in (("a", "full"), ("b", "speed:lcut=2,deep=1")):
        out = tmp_path / name
        args = ["eval", "--methods", methods, "--tasks", "niah,fidelity", "--lengths", "300"]
        args += ["--samples", "1", "--json", "--out", str(out)]
        code, _, _ = run_cli(args, monkeypatch, capsys, model=word_model)
        assert code == 0
        outs.append(str(out))
    code, page, _ = run_cli(["eval-report", *outs, "--command", "make study"], monkeypatch, capsys)
    assert code == 0
    header, rule, *rows = [line for line in page.splitlines() if line.startswith("|")]
    assert header.startswith("| model | method | niah 300 | ppl 300 | ppl ratio 300 |")
    assert "top-1 agr. 300" in header
    speed = "speed:lcut=2,anchors=bos,deep=1,selfonly=false"
    assert [row.split(" | ")[1] for row in rows] == ["`full`", "`full`", f"`{speed}`"]
    assert all(len(row.split("|")) == len(header.split("|")) for row in rows)
    assert "make study" in page and page.count("fidelity and sanity against its own model") == 2
    code, stdout, _ = run_cli(["eval-report", *outs, "--json"], monkeypatch, capsys)
    assert code == 0 and set(json.loads(stdout)) == set(outs)
    code, _, err = run_cli(["eval-report", outs[0], str(tmp_path / "none")], monkeypatch, capsys)
    assert code == 2 and "does not exist" in err


def test_results_markdown_names_the_setup():
    result = {
        "config": {"model": "m", "dtype": "bfloat16", "split": "eval", "seed": 0,
                   "lengths": [2048], "depths": [0.5], "fidelity_tokens": 64, "n": {"niah": 10}},
        "summary": [{"method": "full", "task": "niah", "length": 2048, "score": 1.0, "n": 10}],
    }  # fmt: skip
    page = results_markdown(result, directory="runs/eval")
    assert "Model `m` (bfloat16)" in page and "niah 10" in page and "runs/eval/misses.md" in page
    assert "| method | niah 2K |\n|---|---:|\n| `full` | 100% |\n" in page  # the overview
    assert "| `full` | 100% (10) |" in page


def test_misses_list_the_wrong_needle_samples():
    records = [
        {"task": "niah", "method": "speed", "length": 2048, "sample": 3, "depth": 0.5,
         "prompt_tokens": 2046, "expected": ["12345"], "answer": "It is | 999.",
         "correct": False},
        {"task": "niah", "method": "full", "length": 2048, "sample": 3, "depth": 0.5,
         "prompt_tokens": 2046, "expected": ["12345"], "answer": "12345", "correct": True},
        {"task": "sanity", "method": "speed", "length": 0, "sample": 0, "exact": False},
    ]  # fmt: skip
    lines = misses_markdown({"records": records}).splitlines()
    assert lines[2:] == ["| niah | `speed` | 2048 | 3 | 0.5 | 2046 | 12345 | It is / 999. |"]


# -- the real model ---------------------------------------------------------------------------
@pytest.mark.real_model
def test_full_finds_the_pass_key(smollm2, tmp_path):
    config = EvalConfig(
        model="smollm2-135m",
        methods=["full"],
        tasks=["niah"],
        lengths=[1024],
        n={"niah": 2},
        depths=[0.25, 0.75],
    )
    result = EvalRunner(smollm2, config, tmp_path).run(progress=False, plots=False)
    assert [r["correct"] for r in result["records"]] == [True, True], result["records"]


def test_eval_reference_option_names_the_yardstick(word_model, tmp_path, monkeypatch, capsys):
    args = ["eval", "--methods", "speed:lcut=2,deep=1", "--tasks", "sanity", "--samples", "1"]
    args += ["--reference", "tiny-tuned", "--out", str(tmp_path)]
    code, stdout, _ = run_cli(args, monkeypatch, capsys, model=word_model)
    assert code == 0 and "compare with full attention on `tiny-tuned`" in stdout
    assert (
        json.loads((tmp_path / "results.json").read_text())["header"]["reference"] == "tiny-tuned"
    )
