"""The OpenAI-compatible server, end to end: a real uvicorn server on loopback with the embedded
model (float32), driven by the official `openai` client and by raw HTTP for malformed input."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from transformers import LlamaConfig, LlamaForCausalLM

from speedkv.cli import app as cli
from speedkv.core.engine import Engine, Request
from speedkv.core.prefix import PrefixCache
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.hf.loading import LoadedModel
from speedkv.prompts.haystack import haystack_text
from speedkv.server import ServerConfig, create_app
from speedkv.server.errors import validation_message
from speedkv.server.prepare import _nth_seed
from speedkv.server.schemas import SEED_MAX, SEED_MIN

from conftest import TINY, random_prompt

KEY = "test-key"
MODEL = "smollm2-135m"
SPEED = "speed:lcut=22,anchors=bos,deep=1"
SPEED_CANONICAL = "speed:lcut=22,anchors=bos,deep=1,selfonly=false"
QUESTION = "Name three rivers in Europe."


class LiveServer:
    """uvicorn in a background thread on a free loopback port."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, args=([self.sock],), daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", KEY)
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=300, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as 'name{label="value"}' -> value."""
        text = httpx.get(f"{self.url}/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return out

    def wait_for(self, predicate, timeout: float = 60.0) -> dict[str, float]:
        deadline = time.time() + timeout
        while True:
            metrics = self.metrics()
            if predicate(metrics):
                return metrics
            assert time.time() < deadline, f"metrics never satisfied the condition: {metrics}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server(smollm2):
    config = ServerConfig(
        model_name=MODEL,
        api_key=KEY,
        max_batch=8,
        max_queue=16,
        max_prompt_tokens=512,
        max_tokens_limit=64,
    )
    live = LiveServer(create_app(Engine(smollm2), config))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def small_server(smollm2):
    """One running sequence, one waiting, SPEED only: for 429 and --fixed-method."""
    config = ServerConfig(
        model_name=MODEL, method=SPEED, fixed_method=True, max_batch=1, max_queue=1
    )
    live = LiveServer(create_app(Engine(smollm2), config))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def speedkv_generate(args, smollm2, monkeypatch, capsys) -> dict:
    """`speedkv generate ARGS --json` in this process, on the already loaded model."""
    monkeypatch.setattr("speedkv.hf.loading.load_model", lambda *a, **k: smollm2)
    monkeypatch.setattr(sys, "argv", ["speedkv", "generate", *args, "--json"])
    try:
        cli.main()
    except SystemExit as stop:
        assert stop.code in (0, None)
    return json.loads(capsys.readouterr().out)


def chat(client, content, method=None, ignore_eos=False, **kwargs):
    options = {"method": method} if method else {}
    if ignore_eos:
        options["ignore_eos"] = True
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        extra_body={"speedkv": options} if options else None,
        **kwargs,
    )


# -- output equals `speedkv generate` ------------------------------------------------------
@pytest.mark.real_model
@pytest.mark.parametrize("method", ["full", SPEED])
def test_chat_greedy_equals_speedkv_generate(client, smollm2, monkeypatch, capsys, method):
    expected = speedkv_generate(
        [QUESTION, "--method", method, "-n", "12"], smollm2, monkeypatch, capsys
    )
    reply = chat(client, QUESTION, method, max_tokens=12)
    choice = reply.choices[0]
    assert choice.message.content == expected["text"]
    assert choice.finish_reason == expected["finish_reason"]
    assert reply.usage.prompt_tokens == len(expected["prompt_ids"])
    assert reply.usage.completion_tokens == len(expected["output_ids"])
    assert reply.speedkv[0]["method"] == expected["method"]
    assert reply.speedkv[0]["kv_bytes"] == expected["kv_bytes"]


@pytest.mark.real_model
def test_streamed_chat_equals_whole_answer(client):
    whole = chat(client, QUESTION, SPEED, max_tokens=12)
    stream = chat(
        client, QUESTION, SPEED, max_tokens=12, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text == whole.choices[0].message.content
    assert finishes[-1] == whole.choices[0].finish_reason and set(finishes[:-1]) == {None}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.model_dump(exclude={"prompt_tokens_details"}) == (
        whole.usage.model_dump(exclude={"prompt_tokens_details"})
    )
    # the same prompt again: all of it but the last token came from the prefix cache
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


@pytest.mark.real_model
def test_completion_of_raw_text_equals_the_engine(client, server, smollm2, monkeypatch, capsys):
    prompt = "The three largest cities of Italy are"
    expected = speedkv_generate(
        [prompt, "--raw", "--method", SPEED, "-n", "10"], smollm2, monkeypatch, capsys
    )
    extra = {"speedkv": {"method": SPEED}}
    whole = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, extra_body=extra
    )
    assert whole.choices[0].text == expected["text"]
    assert whole.usage.prompt_tokens == len(expected["prompt_ids"])
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, extra_body=extra, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected["text"]
    # token ids are a prompt too
    by_ids = client.completions.create(
        model=MODEL, prompt=expected["prompt_ids"], max_tokens=10, temperature=0, extra_body=extra
    )
    assert by_ids.choices[0].text == expected["text"]


@pytest.mark.real_model
def test_stop_strings(client):
    free = chat(client, QUESTION, max_tokens=12).choices[0].message.content
    words = free.split()
    stop = words[len(words) // 2]
    cut = chat(client, QUESTION, max_tokens=12, stop=[stop, "no such text"])
    assert cut.choices[0].message.content == free[: free.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = chat(client, QUESTION, max_tokens=12, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == free[: free.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.real_model
def test_per_request_method_changes_the_cache(client):
    full = chat(client, QUESTION, max_tokens=4)
    speed = chat(client, QUESTION, SPEED, max_tokens=4)
    assert full.speedkv[0]["method"] == "full"
    assert speed.speedkv[0]["method"] == SPEED_CANONICAL
    assert speed.speedkv[0]["kv_bytes"] < full.speedkv[0]["kv_bytes"]
    with pytest.raises(openai.BadRequestError) as bad:
        chat(client, QUESTION, "speed:lcut=99,deep=1", max_tokens=4)
    assert bad.value.code == "invalid_method" and "lcut" in bad.value.message


@pytest.mark.real_model
def test_concurrent_requests_are_batched_and_each_equals_its_solo_run(client, server, smollm2):
    engine = Engine(smollm2)
    tokenizer = smollm2.tokenizer
    prompts = ["The Nile flows", "Paris is a city", "Water boils at"]
    methods = ["full", SPEED, SPEED]
    solo = [
        engine.generate(
            [
                Request(
                    tokenizer(p)["input_ids"],
                    make_policy(m, smollm2.shape),
                    SamplingParams(max_new_tokens=10, ignore_eos=True),
                )
            ]
        )[0].text
        for p, m in zip(prompts, methods)
    ]
    before = server.metrics()

    def ask(i):
        return client.completions.create(
            model=MODEL,
            prompt=prompts[i],
            max_tokens=10,
            temperature=0,
            extra_body={"speedkv": {"method": methods[i], "ignore_eos": True}},
        )

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, range(len(prompts))))
    assert [a.choices[0].text for a in answers] == solo
    after = server.metrics()
    steps = after["speedkv_decode_batch_size_count"] - before["speedkv_decode_batch_size_count"]
    rows = after["speedkv_decode_batch_size_sum"] - before["speedkv_decode_batch_size_sum"]
    assert rows == len(prompts) * 9  # every token after the first came from a decode step
    assert steps < rows  # and some steps ran several sequences at once


# -- disconnects, metrics, health ------------------------------------------------------------
@pytest.mark.real_model
def test_disconnect_mid_stream_frees_the_kv_cache(client, server):
    cancelled = 'speedkv_sequences_finished_total{reason="cancelled"}'
    before = server.metrics().get(cancelled, 0.0)
    stream = chat(client, QUESTION, max_tokens=64, stream=True, ignore_eos=True)
    for count, _ in enumerate(stream):
        if count == 3:
            break
    held = server.metrics()
    assert held["speedkv_kv_cache_bytes"] > 0 and held["speedkv_requests_running"] == 1
    stream.close()
    after = server.wait_for(
        lambda m: m["speedkv_kv_cache_bytes"] == 0 and m["speedkv_requests_running"] == 0
    )
    assert after[cancelled] == before + 1
    assert after["speedkv_time_to_first_token_seconds_count"] > 0
    assert after["speedkv_generation_tokens_total"] > 0


@pytest.mark.real_model
def test_models_and_health(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].speedkv["per_request_methods"] is True
    assert client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(f"{server.url}/health").json()
    assert health == {"status": "ok", "model": MODEL, "running": 0, "waiting": 0}


# -- limits and errors -----------------------------------------------------------------------
def _chat_body(**overrides):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    body.update(overrides)
    return body


LONG = "word " * 600  # more than the test server's 512-token prompt limit


@pytest.mark.real_model
@pytest.mark.parametrize(
    "path, body, status, param, says",
    [
        ("/v1/chat/completions", b'{"model": "x", "messages": [', 400, None, "not valid JSON"),
        ("/v1/chat/completions", b"[1, 2]", 400, None, "JSON object"),
        ("/v1/chat/completions", _chat_body(max_tokens=-5), 400, "max_tokens", "greater than"),
        ("/v1/chat/completions", _chat_body(max_tokens="5"), 400, "max_tokens", "integer"),
        ("/v1/chat/completions", _chat_body(temperature="hot"), 400, "temperature", "number"),
        ("/v1/chat/completions", _chat_body(stop=5), 400, "stop", "valid"),
        ("/v1/chat/completions", _chat_body(n=0), 400, "n", "greater than"),
        ("/v1/chat/completions", _chat_body(colour="red"), 400, "colour", "Unrecognized"),
        ("/v1/chat/completions", _chat_body(speedkv={"method": 3}), 400, "speedkv", "string"),
        ("/v1/chat/completions", _chat_body(speedkv={"method": "nosuch"}), 400,
         "speedkv.method", "unknown method"),
        ("/v1/chat/completions", _chat_body(speedkv={"method": "specprefill:speculator=/tmp"}),
         400, "speedkv.method", "only use the served model"),
        ("/v1/chat/completions", _chat_body(messages=[]), 400, "messages", "at least 1"),
        ("/v1/chat/completions", _chat_body(messages=[{"role": "user", "content": LONG}]), 400,
         "messages", "at most 512"),
        ("/v1/chat/completions", _chat_body(max_tokens=65), 400, "max_tokens", "at most 64"),
        ("/v1/chat/completions", _chat_body(presence_penalty=1.0), 400, "presence_penalty",
         "not supported"),
        ("/v1/chat/completions", _chat_body(model="gpt-4"), 404, "model", "does not exist"),
        ("/v1/completions", {"model": MODEL, "prompt": [5, 10**6]}, 400, "prompt", "vocabulary"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", "at least 1 char"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": [""]}, 400, "stop",
         "at least 1 char"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo",
         "not supported"),
        ("/v1/completions", {"model": MODEL, "prompt": "\ud800"}, 400, "prompt", "unicode"),
        ("/v1/chat/completions", _chat_body(messages=[{"role": "user", "content": "\udc00"}]),
         400, "messages.0.content", "Unicode"),
        ("/v1/nowhere", {}, 404, None, "Invalid URL"),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_shaped_4xx(server, path, body, status, param, says):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}{path}", content=content, headers=headers)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and says in error["message"]


@pytest.mark.real_model
def test_body_size_limit(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    huge = json.dumps(_chat_body(messages=[{"role": "user", "content": "x" * 5_000_000}]))

    def chunks():
        for at in range(0, len(huge), 65536):
            yield huge[at : at + 65536].encode()

    for content in (huge.encode(), chunks()):  # with Content-Length, and chunked
        response = httpx.post(f"{server.url}/v1/chat/completions", content=content, headers=headers)
        assert response.status_code == 413
        assert "limit" in response.json()["error"]["message"]


@pytest.mark.real_model
def test_api_key_is_required(server):
    for key in ("wrong-key", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.post(
            f"{server.url}/v1/chat/completions", json=_chat_body(), headers=headers
        )
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong-key").models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # open, like /metrics
    # and the server still serves
    assert chat(server.client(), "Hi", max_tokens=2).choices[0].finish_reason in {"stop", "length"}


@pytest.mark.real_model
def test_full_queue_answers_429_and_fixed_method_holds(small_server):
    client = small_server.client()
    with pytest.raises(openai.BadRequestError) as bad:
        chat(client, "Hi", "full", max_tokens=2)
    assert bad.value.code == "method_not_allowed"
    same = chat(client, "Hi", SPEED, max_tokens=2)  # naming the server's own method is fine
    assert same.speedkv[0]["method"] == SPEED_CANONICAL

    # it holds the only batch slot for longer than the queued client below waits (4000 tokens
    # are a minute or more here; closing the stream cancels it once the checks are done)
    running = chat(client, QUESTION, max_tokens=4000, stream=True, ignore_eos=True)
    next(iter(running))
    prefilled = small_server.metrics()["speedkv_prompt_tokens_total"]

    def wait_then_give_up():
        """A client that gives up while its request is still queued (after 10 s: long enough
        for the 429 below on a busy machine, which once missed a 4 s window)."""
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{small_server.url}/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
                timeout=httpx.Timeout(30, read=10),
            )

    with ThreadPoolExecutor(1) as pool:
        # the second request waits in the queue: no response until it gets the slot
        gives_up = pool.submit(wait_then_give_up)
        small_server.wait_for(lambda m: m["speedkv_requests_waiting"] == 1)
        with pytest.raises(openai.RateLimitError) as busy:
            chat(client, "Hi", max_tokens=2)
        assert busy.value.code == "rate_limit_exceeded"
        assert busy.value.response.headers["retry-after"] == "1"
        gives_up.result(timeout=60)
    # the queued request left without ever being prefilled
    small_server.wait_for(lambda m: m["speedkv_requests_waiting"] == 0)
    running.close()
    metrics = small_server.wait_for(lambda m: m["speedkv_requests_running"] == 0)
    assert metrics["speedkv_kv_cache_bytes"] == 0
    assert metrics["speedkv_prompt_tokens_total"] == prefilled
    assert metrics["speedkv_requests_rejected_total"] == 1
    assert metrics['speedkv_sequences_finished_total{reason="cancelled"}'] == 2
    assert chat(client, "Hi", max_tokens=2).choices[0].message.content  # still serving


@pytest.mark.real_model
def test_several_choices_streamed_and_seeded(client):
    def ask(**kwargs):
        return client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=6, n=2, temperature=1.0, **kwargs
        )

    first, again = ask(seed=11), ask(seed=11)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 12 and first.usage.prompt_tokens == 4
    streamed = list(ask(seed=11, stream=True))
    for index in (0, 1):
        text = "".join(c.choices[0].text for c in streamed if c.choices[0].index == index)
        assert text == first.choices[index].text
    assert sorted(c.choices[0].index for c in streamed if c.choices[0].finish_reason) == [0, 1]


# -- prefix caching ---------------------------------------------------------------------------
HITS, MISSES = "speedkv_prefix_cache_hits_total", "speedkv_prefix_cache_misses_total"
REUSED = "speedkv_prefix_cache_reused_tokens_total"
EVICTIONS = "speedkv_prefix_cache_evictions_total"
ENTRIES, CACHED_BYTES = "speedkv_prefix_cache_entries", "speedkv_prefix_cache_bytes"
DOCUMENT_TOKENS = 2000  # its prefill is nearly all of the first answer's time


@pytest.fixture(scope="module")
def document_server(smollm2):
    """Prompts up to the model's context, prefix caching as `speedkv serve` has it."""
    live = LiveServer(create_app(Engine(smollm2), ServerConfig(model_name=MODEL, api_key=KEY)))
    yield live
    live.stop()


def ask_about(client, document: str, question: str, method: str):
    """The document as the system message, the question as the user's."""
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": document}, {"role": "user", "content": question}],
        max_tokens=2,
        temperature=0,
        extra_body={"speedkv": {"method": method}},
    )


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


@pytest.mark.real_model
@pytest.mark.parametrize("method", ["full", SPEED])
def test_a_second_question_about_a_document_skips_its_prefill(document_server, smollm2, method):
    document = haystack_text(smollm2.tokenizer, DOCUMENT_TOKENS)
    client = document_server.client()
    before = document_server.metrics()
    first = ask_about(client, document, "Who wrote this text?", method)
    second = ask_about(client, document, "What is its main idea?", method)
    after = document_server.metrics()
    assert first.usage.prompt_tokens > DOCUMENT_TOKENS - 100
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    reused = second.speedkv[0]["reused_tokens"]
    # everything up to the question: the document and the template around it
    assert reused == second.usage.prompt_tokens_details.cached_tokens
    assert reused > first.usage.prompt_tokens - 16
    ttfts = first.speedkv[0]["ttft_s"], second.speedkv[0]["ttft_s"]
    assert ttfts[1] <= 0.1 * ttfts[0], ttfts
    assert (delta(before, after, HITS), delta(before, after, MISSES)) == (1, 1)
    assert delta(before, after, REUSED) == reused
    assert after[CACHED_BYTES] > 0 and after[ENTRIES] >= 2


@pytest.mark.real_model
@pytest.mark.parametrize("method", ["full", SPEED])
def test_multi_turn_chat_reuses_the_first_turn(client, method):
    def say(messages):
        return client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=16,
            temperature=0,
            extra_body={"speedkv": {"method": method}},
        )

    turn = [{"role": "user", "content": "Name a river in Europe."}]
    first = say(turn)
    answer = {"role": "assistant", "content": first.choices[0].message.content}
    second = say([*turn, answer, {"role": "user", "content": "How long is it?"}])
    reused = second.speedkv[0]["reused_tokens"]
    assert second.usage.prompt_tokens_details.cached_tokens == reused
    # the first turn's prompt and its answer, up to (not including) its last generated token
    prompt, answer_tokens = first.usage.prompt_tokens, first.usage.completion_tokens
    assert prompt < reused <= prompt + answer_tokens - 1


def cold_completions(model: LoadedModel, prompts: list[str], method: str, tokens: int) -> list:
    """What an engine without a prefix cache answers to each prompt alone (greedy)."""
    engine = Engine(model)
    requests = [
        Request(
            model.tokenizer(p)["input_ids"],
            make_policy(method, model.shape),
            SamplingParams(max_new_tokens=tokens, ignore_eos=True),
        )
        for p in prompts
    ]
    return [engine.generate([r])[0].text for r in requests]


def complete(client, prompt, method: str, tokens: int, **kwargs):
    return client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=tokens,
        temperature=0,
        extra_body={"speedkv": {"method": method, "ignore_eos": True}},
        **kwargs,
    )


@pytest.mark.real_model
def test_concurrent_requests_sharing_a_prefix_equal_sequential_ones(client, smollm2):
    document = haystack_text(smollm2.tokenizer, 150, start=40)
    prompts = [f"{document}\n\nQuestion: {q}\nAnswer:" for q in ("Who?", "Where?", "When?")]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: complete(client, p, SPEED, 6), prompts))
    alone = [complete(client, p, SPEED, 6) for p in prompts]
    texts = [a.choices[0].text for a in together]
    assert texts == [a.choices[0].text for a in alone]
    assert texts == cold_completions(smollm2, prompts, SPEED, 6)
    # the first one prefilled the document; the others started from its cache
    reused = sorted(a.speedkv[0]["reused_tokens"] for a in together)
    document_tokens = len(smollm2.tokenizer(document)["input_ids"])
    assert reused[0] == 0 and reused[1] >= document_tokens - 1


@pytest.mark.real_model
def test_a_cancelled_request_leaves_the_prefix_cache_consistent(client, server, smollm2):
    document = haystack_text(smollm2.tokenizer, 120, start=80)
    kept, dropped = f"{document}\n\nIn short,", f"{document}\n\nTo sum up,"
    first = complete(client, kept, "full", 6)
    before = server.metrics()
    stream = complete(client, dropped, "full", 64, stream=True)
    for count, _ in enumerate(stream):
        if count == 3:
            break
    stream.close()  # the client leaves: its sequence is cancelled mid-decode
    after = server.wait_for(lambda m: m["speedkv_requests_running"] == 0)
    assert delta(before, after, HITS) == 1  # it had extended the document's cached prefix
    again = complete(client, kept, "full", 6)
    resumed = complete(client, dropped, "full", 6)  # from what the cancelled one left
    assert again.choices[0].text == first.choices[0].text
    assert again.speedkv[0]["reused_tokens"] == again.usage.prompt_tokens - 1
    assert resumed.speedkv[0]["reused_tokens"] == resumed.usage.prompt_tokens - 1
    assert resumed.choices[0].text == cold_completions(smollm2, [dropped], "full", 6)[0]
    errors = 'speedkv_sequences_finished_total{reason="error"}'
    assert server.metrics().get(errors, 0.0) == before.get(errors, 0.0)


# -- schemathesis ------------------------------------------------------------------------
SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"


def tiny_model_with_tokenizer(tokenizer) -> LoadedModel:
    """A 2-layer random Llama over SmolLM2's tokenizer: the whole text path of the server at
    a fraction of the real model's cost."""
    torch.manual_seed(0)
    shape = {**TINY, "num_hidden_layers": 2, "vocab_size": len(tokenizer)}
    hf = LlamaForCausalLM(LlamaConfig(**shape)).eval().requires_grad_(False)
    return LoadedModel(name=MODEL, hf_model=hf, tokenizer=tokenizer, source="memory")


@pytest.mark.real_model
@pytest.mark.skipif(not SCHEMATHESIS.exists(), reason="schemathesis is not installed")
def test_schemathesis_finds_no_server_error(smollm2, tmp_path):
    """Requests generated from the server's own OpenAPI spec, valid and not: never a 5xx.
    A tiny model and tight limits keep the run short; the HTTP and text paths are the real
    ones."""
    config = ServerConfig(
        model_name=MODEL, api_key=KEY, max_prompt_tokens=256, max_tokens_limit=4, max_queue=16
    )
    model = tiny_model_with_tokenizer(smollm2.tokenizer)
    live = LiveServer(create_app(Engine(model), config))
    try:
        result = subprocess.run(
            [
                str(SCHEMATHESIS), "run", f"{live.url}/openapi.json",
                "--checks", "not_a_server_error",
                "--phases", "coverage,fuzzing",
                "--max-examples", "3",
                "--suppress-health-check", "all",
                "--header", f"Authorization: Bearer {KEY}",
                "--request-timeout", "120",
                "--workers", "1",
                "--seed", "1",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,  # its cache directory goes there, not into the repository
        )  # fmt: skip
    finally:
        live.stop()
    assert result.returncode == 0, result.stdout[-4000:]
    assert "No issues found" in result.stdout


# -- the scheduler alone, on tiny models -------------------------------------------------------
def test_scheduler_queue_batching_and_cancellation(tiny, tiny_engine):
    from speedkv.server.metrics import ServerMetrics
    from speedkv.server.scheduler import Job, QueueFull, Scheduler

    def request(seed, new_tokens):
        policy = make_policy("speed:lcut=3,anchors=bos,deep=1", tiny.shape)
        sampling = SamplingParams(max_new_tokens=new_tokens)
        return Request(random_prompt(20 + seed, seed=seed), policy, sampling)

    alone = tiny_engine.generate([request(1, 6)])[0].output_ids
    metrics = ServerMetrics()
    scheduler = Scheduler(tiny_engine, max_batch=2, max_queue=2, metrics=metrics)

    def value(name, labels=None):
        return metrics.registry.get_sample_value(name, labels)

    async def scenario():
        loop = asyncio.get_running_loop()
        short = Job([request(1, 6)], loop, time.perf_counter())
        long = Job([request(2, 400)], loop, time.perf_counter())
        for job in (short, long):
            scheduler.submit(job)
        with pytest.raises(QueueFull):  # not started yet: both still wait, the queue is full
            scheduler.submit(Job([request(3, 2)], loop, time.perf_counter()))
        scheduler.start()
        tokens = []
        while True:
            _, event = await short.events.get()
            tokens.append(event.token_id)
            if event.finished:
                break
        for _ in range(3):
            await long.events.get()
        scheduler.cancel(long)
        return tokens

    try:
        tokens = asyncio.run(scenario())
        deadline = time.time() + 30
        while value("speedkv_requests_running") != 0 and time.time() < deadline:
            time.sleep(0.01)
    finally:
        scheduler.stop()
    assert tokens == alone  # batched with another sequence, it decodes as it would alone
    assert value("speedkv_kv_cache_bytes") == 0 and value("speedkv_requests_running") == 0
    assert value("speedkv_requests_rejected_total") == 1
    assert value("speedkv_sequences_finished_total", {"reason": "cancelled"}) == 1
    assert value("speedkv_sequences_finished_total", {"reason": "length"}) == 1
    assert value("speedkv_decode_batch_size_sum") > value("speedkv_decode_batch_size_count")


# -- prefix caching on tiny models -------------------------------------------------------------
def post_completion(live: LiveServer, prompt: list[int], **body) -> dict:
    response = httpx.post(
        f"{live.url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, **body},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_prefix_cache_shows_in_usage_stats_metrics_and_the_model_card(tiny):
    config = ServerConfig(model_name="tiny", prefix_cache_bytes=2**20, prefix_min_tokens=8)
    live = LiveServer(create_app(Engine(tiny), config))
    try:
        document = random_prompt(40, seed=5)
        first = post_completion(live, [*document, 7, 8, 9])
        second = post_completion(live, [*document, 10, 11, 12])
        # n=2: the second choice reuses the first's prompt, which says nothing about the
        # client's earlier requests, so the prompt's cached tokens are the first choice's
        both = post_completion(live, random_prompt(30, seed=6), n=2)
        metrics = live.metrics()
        card = httpx.get(f"{live.url}/v1/models").json()["data"][0]["speedkv"]
    finally:
        live.stop()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 40}
    assert [c["reused_tokens"] for c in second["speedkv"]] == [40]
    assert [c["reused_tokens"] for c in both["speedkv"]] == [0, 29]
    assert both["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert (metrics[HITS], metrics[MISSES], metrics[REUSED]) == (2, 2, 69)
    assert metrics[ENTRIES] == 3 and metrics[EVICTIONS] == 0  # one per finished prompt
    assert 0 < metrics[CACHED_BYTES] <= 2**20
    assert (card["prefix_cache_bytes"], card["prefix_min_tokens"]) == (2**20, 8)


def test_prefix_cache_evicts_the_least_recently_used_past_its_bound(tiny):
    # room for one 40-token prompt and its 3 new tokens, not two
    per_token = tiny.shape.kv_bytes_per_token_layer(torch.float32) * tiny.shape.num_layers
    config = ServerConfig(model_name="tiny", prefix_cache_bytes=60 * per_token)
    live = LiveServer(create_app(Engine(tiny), config))
    try:
        a, b = random_prompt(40, seed=7), random_prompt(40, seed=8)
        post_completion(live, a)
        post_completion(live, b)  # a goes
        again = post_completion(live, a)
        metrics = live.metrics()
    finally:
        live.stop()
    assert again["speedkv"][0]["reused_tokens"] == 0
    assert metrics[EVICTIONS] == 2 and metrics[ENTRIES] == 1  # b went when a came back
    assert metrics[CACHED_BYTES] <= 60 * per_token and metrics[HITS] == 0


def test_prefix_caching_is_off_at_zero_bytes(tiny):
    config = ServerConfig(model_name="tiny", prefix_cache_bytes=0)
    engine = Engine(tiny)
    live = LiveServer(create_app(engine, config))
    try:
        prompt = random_prompt(40, seed=9)
        answers = [post_completion(live, prompt) for _ in range(2)]
        card = httpx.get(f"{live.url}/v1/models").json()["data"][0]["speedkv"]
        metrics = live.metrics()
    finally:
        live.stop()
    assert engine.prefix_cache is None and card["prefix_cache_bytes"] == 0
    assert [a["speedkv"][0]["reused_tokens"] for a in answers] == [0, 0]
    assert metrics[MISSES] == 0 and metrics[ENTRIES] == 0


def test_a_method_that_cannot_reuse_is_served_without_touching_the_prefix_cache(
    smol_tokenizer,
):
    model = tiny_model_with_tokenizer(smol_tokenizer)
    engine = Engine(model, prefix_cache=PrefixCache(2**30, min_tokens=4))
    live = LiveServer(create_app(engine, ServerConfig(model_name=MODEL)))
    prompt = "The river flows past the old mill and into the quiet town below."
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    body["speedkv"] = {"method": "snapkv:window=4", "ignore_eos": True}
    try:
        answers = [
            httpx.post(f"{live.url}/v1/completions", json=body, timeout=60).json() for _ in range(2)
        ]
        metrics = live.metrics()
    finally:
        live.stop()
    ids = smol_tokenizer(prompt)["input_ids"]
    policy = make_policy("snapkv:window=4", model.shape)
    cold = Engine(model).generate([Request(ids, policy, SamplingParams(4, ignore_eos=True))])[0]
    assert [a["choices"][0]["text"] for a in answers] == [cold.text, cold.text]
    assert [a["speedkv"][0]["reused_tokens"] for a in answers] == [0, 0]
    assert len(engine.prefix_cache) == 0
    assert engine.prefix_cache.hits == engine.prefix_cache.misses == 0
    assert metrics.get(MISSES, 0.0) == 0 and metrics.get(ENTRIES, 0.0) == 0


# -- the command -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, says",
    [
        (["--adapter", "/tmp/lora"], "is not an adapter directory"),
        (["--method", "speed:lcut"], "malformed method spec"),
        (["--method", "nosuch"], "unknown method"),
        (["--max-batch", "0"], "max-batch must be at least 1"),
        (["--max-queue", "-1"], "max-queue must be at least 1"),
        (["--max-prompt-tokens", "0"], "max-prompt-tokens must be at least 1"),
        (["--port", "70000"], "port must be between 0 and 65535"),
        (["--api-key", " "], "API key is empty"),
        (["--threads", "-1"], "threads must be 0"),
        (["--log-level", "loud"], "log-level"),
        (["--prefix-cache-bytes", "-1"], "prefix-cache-bytes must be 0"),
        (["--prefix-min-tokens", "0"], "prefix-min-tokens must be at least 1"),
    ],
)
def test_serve_rejects_bad_options_before_loading_the_model(args, says, monkeypatch, capsys):
    def no_loading(*_, **__):
        raise AssertionError("the model must not load")

    monkeypatch.setattr("speedkv.hf.loading.load_model", no_loading)
    monkeypatch.setattr(sys, "argv", ["speedkv", "serve", *args])
    with pytest.raises(SystemExit) as stop:
        cli.main()
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert says in err and "Traceback" not in err


# -- pure helpers ----------------------------------------------------------------------------
def test_validation_messages_name_the_parameter():
    assert validation_message(
        [{"type": "extra_forbidden", "loc": ("body", "colour"), "msg": "Extra inputs"}]
    ) == ("Unrecognized request argument supplied: colour", "colour")
    assert validation_message(
        [{"type": "int_type", "loc": ("body", "stop", "list[str]", 0), "msg": "bad"}]
    ) == ("stop.0: bad", "stop")
    assert validation_message([{"type": "missing", "loc": ("body", "model"), "msg": "x"}]) == (
        "'model' is a required property",
        "model",
    )


def test_choice_seeds_are_distinct_and_in_range():
    assert [_nth_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert _nth_seed(SEED_MAX, 1) == SEED_MIN
    assert all(SEED_MIN <= _nth_seed(SEED_MAX - 1, i) <= SEED_MAX for i in range(4))


def test_server_config_is_checked(tiny):
    from speedkv.errors import UserError

    for bad, says in [
        ({"max_batch": 0}, "max-batch"),
        ({"max_queue": 0}, "max-queue"),
        ({"max_prompt_tokens": tiny.shape.max_positions}, "max-prompt-tokens"),
        ({"method": "speed:lcut=99,deep=1"}, "lcut"),
        ({"api_key": " "}, "API key"),
        ({"prefix_cache_bytes": -1}, "prefix-cache-bytes"),
        ({"prefix_min_tokens": 0}, "prefix-min-tokens"),
    ]:
        with pytest.raises(UserError, match=says):
            ServerConfig(model_name="m", **bad).validate(tiny.shape)
    config = ServerConfig(model_name="m", method="speed:lcut=2,deep=1").validate(tiny.shape)
    assert config.method == "speed:lcut=2,anchors=bos,deep=1,selfonly=false"
    assert config.max_prompt_tokens == tiny.shape.max_positions - 1
