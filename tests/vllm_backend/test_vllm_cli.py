"""`speedkv generate --backend vllm`: the same prompt ids, the same greedy tokens as speedkv's
own engine (float32, with the shipped SPEED adapter merged), the same JSON fields; and what the
vLLM backend does not run is one sentence and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_cli

ADAPTER = str(Path(__file__).resolve().parents[2] / "adapters" / "smollm2-135m-speed22-bos")
PROMPT = "Name three primary colors and say which one the sky is."


def generate(backend: str, monkeypatch, capsys) -> dict:
    args = ["generate", PROMPT, "--method", "speed:lcut=22,anchors=bos,deep=1",
            "--adapter", ADAPTER, "--dtype", "float32", "-n", "16", "--json",
            "--backend", backend]  # fmt: skip
    if backend == "vllm":  # eager keeps the suite's time: the compiled path has its own tests
        args.append("--vllm-arg=--enforce-eager")
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_generate_on_vllm_equals_speedkv_with_the_adapter(monkeypatch, capsys):
    ours = generate("speedkv", monkeypatch, capsys)
    theirs = generate("vllm", monkeypatch, capsys)
    assert theirs["prompt_ids"] == ours["prompt_ids"]
    assert theirs["output_ids"] == ours["output_ids"]
    assert theirs["text"] == ours["text"]
    for field in ("ttft_s", "tpot_s", "kv_bytes", "layer_lengths", "finish_reason", "method"):
        assert field in theirs
    n = len(theirs["prompt_ids"])
    assert theirs["layer_lengths"] == [n] * 22 + [2] * 8  # the anchor and the last prompt token
    assert theirs["backend"] == "vllm" and theirs["ttft_s"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "snapkv"], "runs full and speed"),
        (["--method", "speed:lcut=31"], "between 0 and 30"),
        (["--method", "speed:lcut=22,deep=turn"], "token count"),
        (["--weights", "int8"], "drop them with --backend vllm"),
    ],
)
def test_what_the_vllm_backend_refuses(args, message, monkeypatch, capsys):
    code, _, err = run_cli(["generate", "hi", "--backend", "vllm", *args], monkeypatch, capsys)
    assert code == 2 and message in err and "Traceback" not in err


def test_bench_on_vllm_writes_the_same_report(tmp_path, monkeypatch, capsys):
    out = tmp_path / "bench"
    args = ["bench", "--backend", "vllm", "--methods", "speed:lcut=15,anchors=bos,deep=1",
            "--lengths", "512", "--max-new-tokens", "4", "--repeats", "2", "--out", str(out),
            "--json", "--vllm-arg=--enforce-eager"]  # fmt: skip
    code, stdout, err = run_cli(args, monkeypatch, capsys)
    assert code == 0, err
    result = json.loads(stdout)
    assert result["decode"] == "vllm" and result["methods"] == [
        "full",
        "speed:lcut=15,anchors=bos,deep=1",
    ]
    cells = {c["method"]: c for c in result["cells"]}
    assert cells["full"]["repeats"] == 2 and cells["full"]["ttft_s"] > 0
    # 513 tokens: 5 blocks in 30 layers for stock; 5 in the 15 lower + 1 in the 15 upper
    assert cells["speed:lcut=15,anchors=bos,deep=1"]["kv_ratio"] == pytest.approx(6 * 15 / (5 * 30))
    assert (out / "results.json").is_file() and (out / "table.md").is_file()
