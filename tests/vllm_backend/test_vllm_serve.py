"""`speedkv serve --backend vllm`: vLLM's own OpenAI server running SPEED with the shipped
adapter, answering the official openai client; what SPEED cannot answer is a 400."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import openai
import pytest

from speedkv.bench.measure.loadtest import parse_metrics

from helpers import free_port, stop_server, wait_until_healthy

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = ROOT / "adapters" / "smollm2-135m-speed22-bos"
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def server():
    port = free_port()
    command = [
        sys.executable, "-m", "speedkv.cli.app", "serve", "--backend", "vllm",
        "--method", "speed:lcut=22,anchors=bos,deep=1", "--adapter", str(ADAPTER),
        "--port", str(port),  # --dtype auto: bfloat16 only where the CPU has bf16 products
        # eager: compiling takes most of a start, and the compiled model has its own tests
        # (test_vllm_compiled.py, the pipeline-parallel ones); what is tested here is the server
        "--vllm-arg=--enforce-eager",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server as users run it
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log,
                                   text=True)  # fmt: skip
        try:
            wait_until_healthy(process, base, log)
            yield base
        finally:
            stop_server(process)


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused")


def test_chat_and_completions_streaming_and_not(server):
    api = client(server)
    chat = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0,
    )  # fmt: skip
    assert chat.choices[0].message.content.strip()
    assert chat.usage.completion_tokens > 0
    pieces = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0, stream=True,
    )  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert streamed == chat.choices[0].message.content  # greedy: the same text either way
    text = api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                  temperature=0)  # fmt: skip
    assert text.choices[0].text
    chunks = api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12,
                                    temperature=0, stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == text.choices[0].text


def test_prompt_logprobs_are_refused(server):
    api = client(server)
    with pytest.raises(openai.BadRequestError, match="SPEED"):
        api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2,
                               echo=True, logprobs=1)  # fmt: skip
    reply = httpx.post(server + "/v1/completions", json={
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 2, "prompt_logprobs": 1,
    }, timeout=60)  # fmt: skip
    assert reply.status_code == 400
    assert "SPEED" in reply.text


def prefix_cache_counters(base: str) -> tuple[float, float]:
    """vLLM's own prefix-cache counters: prompt tokens looked up, and found cached."""
    values = parse_metrics(httpx.get(base + "/metrics", timeout=30).text)
    return values["vllm:prefix_cache_queries_total"], values["vllm:prefix_cache_hits_total"]


def test_prefix_caching_is_on_and_counted_by_vllm(server):
    """Two questions on one document: the second is served from vLLM's prefix cache (on by
    default with SPEED, as for stock models), and vLLM's own /metrics count the hit."""
    from speedkv.prompts.haystack import sentence_pool

    document = " ".join(sentence_pool()[:60])  # about 1.5K tokens of essay text
    api = client(server)
    queries, hits = prefix_cache_counters(server)
    answers = [
        api.chat.completions.create(
            model=MODEL,
            max_tokens=8,
            temperature=0,
            messages=[
                {"role": "system", "content": document},
                {"role": "user", "content": question},
            ],
        )  # fmt: skip
        for question in ("Who wrote this?", "What is the main idea?")
    ]
    queries_after, hits_after = prefix_cache_counters(server)
    prompt = answers[1].usage.prompt_tokens
    assert queries_after - queries >= prompt
    assert hits_after - hits >= prompt // 128 * 128 - 128  # the document's whole blocks


def test_32_concurrent_streaming_clients(server):
    async def one(api: openai.AsyncOpenAI, i: int) -> int:
        stream = await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count to {i + 3}."}],
            max_tokens=24, temperature=0, stream=True,
        )  # fmt: skip
        return sum([1 async for c in stream if c.choices and c.choices[0].delta.content])

    async def all_of_them() -> list:
        api = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(api, i) for i in range(32)), return_exceptions=True)

    results = asyncio.run(all_of_them())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert all(r > 0 for r in results)
