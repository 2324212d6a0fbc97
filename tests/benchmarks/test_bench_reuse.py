"""`speedkv bench-reuse` on a tiny model with SmolLM2's tokenizer: documents of a chosen
length, pairs of reused and from-scratch questions, exact KV, outputs, resume, refusals."""

from __future__ import annotations

import json

import pytest

from speedkv.bench.reuse import QUESTIONS, ReuseBench, ReuseBenchConfig, reuse_cell
from speedkv.errors import UserError
from speedkv.hf.text import encode_messages
from speedkv.prompts.builders import chat_document

from helpers import run_cli

# tiny models are latency-bound: one thread avoids contention on a shared CPU
pytestmark = pytest.mark.usefixtures("one_thread")

SPEED_TURN = "speed:lcut=2,anchors=bos,deep=turn"


def config(**overrides) -> ReuseBenchConfig:
    values = dict(
        model="tiny-words",
        methods=[SPEED_TURN],
        lengths=[160, 240],
        questions=2,
        new_tokens=3,
        repeats=2,
    )
    return ReuseBenchConfig(**(values | overrides))


def test_chat_document_takes_about_the_length_asked(smol_tokenizer):
    for length in (40, 300, 1000):
        text = chat_document(smol_tokenizer, length)
        message = [{"role": "user", "content": text}]
        n = len(encode_messages(smol_tokenizer, message, generation_header=False).ids)
        assert length - 3 <= n <= length
    with pytest.raises(UserError, match="too short for the chat template"):
        chat_document(smol_tokenizer, 10)


def test_cells_pairs_kv_and_outputs(word_model, tmp_path):
    result = ReuseBench(word_model, config(), tmp_path).run(resume=False, progress=False)
    speed = SPEED_TURN + ",selfonly=false"
    cells = {(c["method"], c["length"]): c for c in result["cells"]}
    assert set(cells) == {(m, n) for m in ("full", speed) for n in (160, 240)}
    per = word_model.shape.kv_bytes_per_token_layer(word_model.dtype)
    for n in (160, 240):
        full, cut = cells[("full", n)], cells[(speed, n)]
        d = full["document_tokens"]
        assert n - 3 <= d <= n and cut["document_tokens"] == d
        assert full["pairs"] == 2 * 2 and full["repeats"] == 2
        assert full["same_tokens"] == 1.0  # full attention: reuse changes nothing
        assert full["reused_kv_bytes"] == full["scratch_kv_bytes"]
        assert full["document_kv_bytes"] == 4 * d * per
        # lcut 2 of 4: the upper layers hold BoS and the document's own deep token
        assert cut["document_kv_bytes"] == (2 * d + 2 * 2) * per
        assert cut["document_kv_vs_full"] == pytest.approx((2 * d + 4) / (4 * d))
        assert full["document_prefill_vs_full"] == 1.0 == full["reused_ttft_vs_full"]
        for c in (full, cut):
            assert 20 <= c["question_tokens"] <= 40
            assert c["reuse_ratio_min"] <= c["reuse_ratio"] <= c["reuse_ratio_max"]
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert runs[0]["header"]["questions"] == 2
    for run in runs[1:]:
        assert [q["reused_tokens"] for q in run["questions"]] == [run["document_tokens"]] * 2
        assert {q["first"] for q in run["questions"]} == {"reused", "scratch"}  # alternating
    for name in ("results.json", "results.csv", "table.md", "report.md", "reuse.png"):
        assert (tmp_path / name).is_file(), name
    assert "| reused / scratch |" in (tmp_path / "table.md").read_text()


def test_ratios_come_from_pairs_and_from_full_of_the_same_repeat():
    def run(method, repeat, prefill, pairs):
        questions = [
            dict(question=i, question_tokens=30, reused_kv_bytes=1, scratch_kv_bytes=1,
                 same_tokens=True, reused_ttft_s=r, scratch_ttft_s=s)
            for i, (r, s) in enumerate(pairs)
        ]  # fmt: skip
        return dict(
            repeat=repeat, length=100, method=method, document_tokens=100,
            document_prefill_s=prefill, document_kv_bytes=10, questions=questions,
        )  # fmt: skip

    runs = [
        run("full", 0, 2.0, [(0.1, 2.0), (0.3, 2.0)]),
        run("full", 1, 4.0, [(0.2, 4.0), (0.2, 4.0)]),
        run("speed", 0, 1.0, [(0.1, 1.0), (0.1, 1.0)]),
        run("speed", 1, 3.0, [(0.1, 2.0), (0.1, 2.0)]),
    ]
    cell = reuse_cell(runs, "speed", 100)
    assert cell["reuse_ratio"] == pytest.approx(0.075)  # median of 0.1, 0.1, 0.05, 0.05
    assert cell["document_prefill_vs_full"] == pytest.approx((0.5 + 0.75) / 2)
    assert cell["scratch_ttft_vs_full"] == pytest.approx(0.5)
    assert cell["reused_ttft_vs_full"] == pytest.approx(0.5)  # median of 1, 1/3, 0.5, 0.5
    assert (cell["reuse_ratio_min"], cell["reuse_ratio_max"]) == (0.05, 0.1)


def test_resume_measures_only_missing_runs(word_model, tmp_path, monkeypatch):
    ReuseBench(word_model, config(repeats=1), tmp_path).run(resume=False, progress=False)
    measured = []
    original = ReuseBench.measure

    def counting(self, method, document, repeat, new_tokens):
        measured.append((method, repeat, new_tokens))
        return original(self, method, document, repeat, new_tokens)

    monkeypatch.setattr(ReuseBench, "measure", counting)
    result = ReuseBench(word_model, config(repeats=2), tmp_path).run(resume=True, progress=False)
    assert sorted(r for _, r, n in measured if n == 3) == [1, 1, 1, 1]  # 2 methods x 2 lengths
    assert all(c["repeats"] == 2 for c in result["cells"])
    with pytest.raises(UserError, match="other settings"):
        ReuseBench(word_model, config(questions=3), tmp_path).run(resume=True, progress=False)


def test_bad_settings(word_model, tmp_path):
    with pytest.raises(UserError, match="questions must be between 1 and"):
        ReuseBench(word_model, config(questions=len(QUESTIONS) + 1), tmp_path)
    with pytest.raises(UserError, match="leaves no room for a question"):
        ReuseBench(word_model, config(lengths=[1000]), tmp_path)
    with pytest.raises(UserError, match="cannot serve another prompt"):
        ReuseBench(word_model, config(methods=["h2o"]), tmp_path)


def test_cli_refuses_methods_that_cannot_reuse_before_loading(monkeypatch, capsys):
    monkeypatch.setattr(
        "speedkv.hf.loading.load_model", lambda *a, **k: pytest.fail("loaded a model")
    )
    code, _, err = run_cli(["bench-reuse", "--methods", "full;snapkv"], monkeypatch, capsys)
    assert code == 2 and "cannot serve another prompt" in err and "Traceback" not in err


def test_cli_runs_and_prints_the_table(word_model, tmp_path, monkeypatch, capsys):
    args = ["bench-reuse", "--methods", SPEED_TURN, "--lengths", "120", "--questions", "1"]
    args += ["--repeats", "1", "--max-new-tokens", "2", "--out", str(tmp_path), "--json"]
    code, stdout, _ = run_cli(args, monkeypatch, capsys, model=word_model)
    assert code == 0
    result = json.loads(stdout)
    assert [c["method"] for c in result["cells"]] == ["full", SPEED_TURN + ",selfonly=false"]
    assert result["config"]["command"].startswith("speedkv bench-reuse")
