#!/usr/bin/env python3
"""Multi-turn chat served by vLLM, with and without SPEED and prefix caching, in one run.

Each of `--clients` clients holds a conversation of `--turns` turns with one server: a system
prompt every client shares, then a document of its own (essay text from the `calib` split,
about `--doc-tokens` tokens) and a question; each later turn resends the conversation with the
server's answer and a new question, as chat clients do. Clients run at once; each waits for its
answer before its next turn. Every answer is `--max-tokens` tokens (EOS ignored).

Servers, started one after another through `speedkv serve --backend vllm`:
- stock vLLM with its prefix caching (`--method full`),
- vLLM + SPEED with prefix caching (`--method SPEC`, the default),
- vLLM + SPEED without it (`--vllm-arg=--no-enable-prefix-caching`).

Reports generated tokens/s, TTFT p50/p90 over every request and over the later turns alone
(those that can reuse the conversation so far), and the share of prompt tokens vLLM served from
its prefix cache (its own `/metrics` counters): the median of `--repeats` runs of each server,
the servers' order rotated from one repeat to the next, and every run's tokens/s.

    .venv-vllm/bin/python benchmarks/vllm_multiturn.py --out benchmarks/vllm/multiturn
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import httpx

from speedkv.bench.measure.loadtest import Server, framed, parse_metrics, percentile, stream_one

SYSTEM = (
    "You are a careful reading assistant. Answer questions about the document the user gives, "
    "quote it where you can, and say so when the document does not answer a question. "
)
QUESTIONS = [
    "What is the main point of this document?",
    "Which example does the author give for it?",
    "Does the author change their mind anywhere? Where?",
    "Summarise the whole conversation in two sentences.",
]


@dataclass
class ServerRun:
    name: str
    method: str
    prefix_caching: bool
    wall_s: float
    tokens: int
    tokens_per_s: float
    errors: int
    ttft_p50_s: float
    ttft_p90_s: float
    later_ttft_p50_s: float  # turns 2 and on
    later_ttft_p90_s: float
    prompt_tokens: int
    cached_tokens_share: float  # vLLM's prefix cache hits over its queries, in tokens


def documents(model: str, clients: int, tokens: int) -> list[str]:
    from speedkv.hf.loading import load_tokenizer, model_directory
    from speedkv.prompts.haystack import haystack_text

    tokenizer = load_tokenizer(model_directory(model, progress=False))
    return [haystack_text(tokenizer, tokens, split="calib", start=131 * i) for i in range(clients)]


async def converse(client, url: str, args, document: str, results: list) -> None:
    """One client's conversation, turn after turn."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{document}\n\n{QUESTIONS[0]}"}]  # fmt: skip
    for turn in range(args.turns):
        if turn:
            messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        body = {"model": args.model, "messages": messages, "max_tokens": args.max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": True}  # fmt: skip
        result = await stream_one(client, url, body)
        results.append((turn, result))
        if result.error is not None:
            return
        messages.append({"role": "assistant", "content": result.text})


async def run_clients(url: str, args, docs: list[str]) -> tuple[list, float]:
    results: list = []
    limits = httpx.Limits(max_connections=len(docs) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(converse(client, url, args, d, results) for d in docs))
        return results, time.perf_counter() - start


def measure(args, name: str, method: str, caching: bool, docs: list[str]) -> ServerRun:
    print(f"[multiturn] {name}", file=sys.stderr, flush=True)
    extra = () if caching else ("--vllm-arg=--no-enable-prefix-caching",)
    server = Server(args, method, len(docs), "vllm", extra)
    try:
        server.wait_ready()
        warm = {"model": args.model, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4}  # fmt: skip
        httpx.post(f"{server.url}/v1/chat/completions", json=warm, timeout=300).raise_for_status()
        before = parse_metrics(httpx.get(f"{server.url}/metrics").text)
        results, wall = asyncio.run(run_clients(server.url, args, docs))
        after = parse_metrics(httpx.get(f"{server.url}/metrics").text)
    finally:
        server.stop()

    def counter(name: str) -> float:
        key = next((k for k in (f"{name}_total", name) if k in after), None)
        return after.get(key, 0.0) - before.get(key, 0.0) if key else 0.0

    good = [(turn, r) for turn, r in results if r.error is None]
    ttfts = [r.ttft_s for _, r in good if r.ttft_s is not None]
    later = [r.ttft_s for turn, r in good if turn and r.ttft_s is not None]
    tokens = sum(r.completion_tokens for _, r in good)
    queries = counter("vllm:prefix_cache_queries")
    return ServerRun(
        name=name, method=method, prefix_caching=caching, wall_s=wall, tokens=tokens,
        tokens_per_s=tokens / wall, errors=len(results) - len(good),
        ttft_p50_s=percentile(ttfts, 0.5), ttft_p90_s=percentile(ttfts, 0.9),
        later_ttft_p50_s=percentile(later, 0.5), later_ttft_p90_s=percentile(later, 0.9),
        prompt_tokens=sum(r.prompt_tokens for _, r in good),
        cached_tokens_share=counter("vllm:prefix_cache_hits") / queries if queries else 0.0,
    )  # fmt: skip


def median_run(runs: list[ServerRun]) -> ServerRun:
    """One server's repeats: the median of each figure, errors summed."""
    numbers = {
        f.name: statistics.median(getattr(r, f.name) for r in runs)
        for f in fields(ServerRun)
        if f.type in ("float", "int")
    }
    numbers["errors"] = sum(r.errors for r in runs)
    return dataclasses.replace(runs[0], **numbers)


def markdown(summary: list[ServerRun], runs: list[ServerRun]) -> str:
    lines = [
        "| server | tokens/s (median, runs) | errors | TTFT p50 / p90 s | later turns TTFT "
        "p50 / p90 s | prompt tokens from the cache |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in summary:
        each = ", ".join(f"{x.tokens_per_s:.1f}" for x in runs if x.name == r.name)
        lines.append(
            f"| {r.name} | {r.tokens_per_s:.1f} ({each}) | {r.errors} | {r.ttft_p50_s:.2f} / "
            f"{r.ttft_p90_s:.2f} | {r.later_ttft_p50_s:.2f} / {r.later_ttft_p90_s:.2f} | "
            f"{100 * r.cached_tokens_share:.0f} % |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="speed", help="the SPEED spec (default: vLLM's default "
                   "cut, the padding-free one nearest 0.75 L)")  # fmt: skip
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--doc-tokens", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--vllm-cpus", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND for the server")
    p.add_argument("--repeats", type=int, default=3, help="runs of every server, interleaved")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out", type=Path, default=Path("runs/multiturn"))
    args = p.parse_args(argv)

    docs = documents(args.model, args.clients, args.doc_tokens)
    speed = f"vLLM + SPEED ({args.method})"
    servers = [("stock vLLM, prefix caching", "full", True),
               (f"{speed}, prefix caching", args.method, True),
               (f"{speed}, no prefix caching", args.method, False)]  # fmt: skip
    from speedkv.bench.machine import machine_facts
    from speedkv.bench.paired import turn_about

    runs: list[ServerRun] = []  # in the order they ran
    # the servers in turn, their order rotated each repeat, so drift hits each alike
    arms = {name: functools.partial(measure, args, name, method, caching, docs)
            for name, method, caching in servers}  # fmt: skip
    done = turn_about(arms, args.repeats, warmup=0, after=lambda _, __, run: runs.append(run))
    summary = [median_run(done.results[name]) for name in arms]

    record = {
        "command": " ".join([".venv-vllm/bin/python benchmarks/vllm_multiturn.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "model": args.model, "clients": args.clients, "turns": args.turns,
        "doc_tokens": args.doc_tokens, "max_tokens": args.max_tokens, "dtype": args.dtype,
        "repeats": args.repeats, "machine": machine_facts(),
        "median": [asdict(r) for r in summary], "runs": [asdict(r) for r in runs],
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(record, indent=2))
    table = framed(record, markdown(summary, runs))
    (args.out / "table.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
