"""The command line: JSON output on the real model, and one clear sentence + exit 2 on bad input."""

import json

import pytest

from helpers import header_only_gguf, run_cli


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", ""], "prompt is empty"),
        (["generate", "hi", "--method", "nosuch"], "unknown method"),
        (["generate", "hi", "--method", "speed:lcut"], "malformed method spec"),
        (["generate", "hi", "-n", "0"], "max-new-tokens must be at least 1"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--top-p", "2"], "top-p"),
        (["generate", "hi", "--top-k", "-3"], "top-k"),
        (["generate", "hi", "--model", "no-such-model"], "no model 'no-such-model'"),
        (["generate", "hi", "--model", "/nonexistent/dir"], "no model '/nonexistent/dir'"),
        (["generate", "--prompt-file", "/nonexistent.txt"], "does not exist"),
        (["generate", "hi", "--dtype", "float8"], "dtype must be"),
        (["generate", "hi", "--max-new-tokens", "abc"], "Invalid value"),
    ],
)
def test_bad_input_before_the_model_loads(args, message, monkeypatch, capsys):
    code, out, err = run_cli(args, monkeypatch, capsys)
    assert code == 2
    assert message in err and "Traceback" not in err
    said = [line for line in err.splitlines() if line.strip() and not line.startswith("[")]
    assert len(said) == 1 and said[0].startswith("error: "), err  # log lines aside, one sentence


def test_unsupported_gguf_architecture(tmp_path, monkeypatch, capsys):
    path = header_only_gguf(tmp_path / "tiny-gpt2.gguf", "gpt2")
    monkeypatch.setenv("SPEEDKV_CACHE", str(tmp_path / "cache"))
    code, _, err = run_cli(["generate", "hi", "--model", str(path)], monkeypatch, capsys)
    assert code == 2 and "GGUF architecture 'gpt2' is not supported" in err


@pytest.mark.real_model
@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hi", "--method", "speed:lcut=31"], "lcut must be between 0 and 30"),
        (["generate", "hi", "--method", "speed:lcut=22,window=3"], "has no option 'window'"),
        (["generate", "word " * 8300, "--raw"], "more than the model's context of 8192"),
        (
            ["generate", "hi", "--method", "fastkv:tsp_rate=1.5"],
            "tsp_rate above 1 is a token count",
        ),
        (["generate", "hi", "--method", "snapkv:retain=0"], "retain must be a fraction"),
        (["generate", "hi", "--method", "gemfilter:filter_layer=30"], "between 0 and 29"),
        (["generate", "hi", "--method", "h2o:heavy=0.1,sink=4"], "has no option 'sink'"),
        (["bench", "--lengths", "9000", "--repeats", "1"], "longer than the model's context"),
        (["bench", "--repeats", "0"], "repeats must be at least 1"),
        (["bench", "--methods", "full;nosuch"], "unknown method"),
        (["bench", "--lengths", "1024,x"], "lengths must be"),
    ],
)
def test_bad_input_that_needs_the_model(args, message, smollm2, monkeypatch, capsys):
    code, _, err = run_cli(args, monkeypatch, capsys, model=smollm2)
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.real_model
def test_generate_json_has_every_field(smollm2, monkeypatch, capsys):
    args = [
        "generate",
        "What is the capital of France?",
        "--method",
        "speed:lcut=22,anchors=bos,deep=1",
        "-n",
        "8",
        "--json",
    ]
    code, out, _ = run_cli(args, monkeypatch, capsys, model=smollm2)
    assert code == 0
    record = json.loads(out)
    for key in (
        "model",
        "method",
        "prompt_ids",
        "output_ids",
        "text",
        "ttft_s",
        "tpot_s",
        "kv_bytes",
        "kv_bytes_final",
        "peak_rss_bytes",
    ):
        assert key in record
    assert record["method"] == "speed:lcut=22,anchors=bos,deep=1,selfonly=false"
    assert 1 <= len(record["output_ids"]) <= 8
    n = len(record["prompt_ids"])
    per = 2 * 3 * 64 * 4  # float32, 3 KV heads of 64
    assert record["kv_bytes"] == (22 * n + 8 * 2) * per
    assert record["peak_rss_bytes"] > 0


def test_models_lists_the_embedded_models(monkeypatch, capsys):
    code, out, _ = run_cli(["models", "--json"], monkeypatch, capsys)
    rows = {r["name"]: r for r in json.loads(out)}
    assert code == 0 and rows["smollm2-135m"]["installed"] is True
    assert "qwen2.5-coder-0.5b" in rows


def test_models_says_where_the_cache_is_and_its_size(tmp_path, monkeypatch, capsys):
    for name, size in [("models/m/model.safetensors", 1_400_000_000), ("kernels/k.so", 10**8)]:
        (tmp_path / name).parent.mkdir(parents=True)
        with (tmp_path / name).open("wb") as sparse:  # its size, without the disk space
            sparse.truncate(size)
    monkeypatch.setenv("SPEEDKV_CACHE", str(tmp_path))
    code, out, _ = run_cli(["models"], monkeypatch, capsys)
    assert code == 0 and f"{tmp_path}, 1.5 GB" in out
