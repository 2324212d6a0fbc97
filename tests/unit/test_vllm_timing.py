"""speedkv.vllm.timing: a request's TTFT and TPOT read from vLLM's own timestamps, on stand-in
outputs with given timestamps (vLLM itself is not needed, and nothing is timed here)."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest

from speedkv.vllm.timing import READY, RESULT, request_times, serve_jobs, timed_generate


def output(tokens: int, metrics) -> SimpleNamespace:
    completion = SimpleNamespace(token_ids=list(range(tokens)))
    return SimpleNamespace(outputs=[completion], metrics=metrics)


def stats(first_token_latency: float, first: float, last: float, tokens: int):
    return SimpleNamespace(first_token_latency=first_token_latency, first_token_ts=first,
                           last_token_ts=last, num_generation_tokens=tokens)  # fmt: skip


def test_ttft_is_vllms_latency_and_tpot_the_decode_steps_between_first_and_last_token():
    got = request_times(output(5, stats(0.75, 100.0, 100.5, 5)))
    assert got.ttft_s == 0.75
    assert got.tpot_s == pytest.approx(0.5 / 4)  # 4 decode steps after the first token


def test_one_new_token_has_no_tpot_and_no_metrics_means_no_times():
    assert request_times(output(1, stats(0.3, 7.0, 7.0, 1))).tpot_s is None
    assert request_times(output(4, None)) is None  # disable_log_stats=True
    assert request_times(output(4, stats(0.0, 0.0, 0.0, 0))) is None  # no first token stamped


def test_a_generate_call_gets_token_ids_and_its_wall_time():
    calls = []

    class Llm:
        def generate(self, prompts, params, use_tqdm):
            calls.append((prompts, params, use_tqdm))
            return ["out"]

    wall, outs = timed_generate(Llm(), [(1, 2, 3)], "params")
    assert outs == ["out"] and isinstance(wall, float)
    assert calls == [([{"prompt_token_ids": [1, 2, 3]}], "params", False)]


def test_a_served_engine_answers_one_line_per_job(monkeypatch, capsys):
    jobs = [{"name": "a", "n": 2}, {"name": "b", "n": 3}]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(json.dumps(j) for j in jobs) + "\n\n"))
    serve_jobs(lambda job: {"name": job["name"], "double": 2 * job["n"]}, {"vllm_version": "x"})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == READY + json.dumps({"vllm_version": "x"})
    assert [json.loads(line.removeprefix(RESULT)) for line in lines[1:]] == [
        {"name": "a", "double": 4}, {"name": "b", "double": 6}]  # fmt: skip
    assert all(line.startswith(RESULT) for line in lines[1:])
