"""Prefix caching in `speedkv serve`, measured: one essay document of about 4K tokens asked two
questions, under each method. The second question's prompt shares everything up to the
question with the first's, so it reuses the cached prefix and prefills only the rest. Prints
the server's own TTFT of each (the per-choice `speedkv` field, from arrival to first token)
and how many prompt tokens the second took from the cache.

    .venv/bin/speedkv serve --port 8011 &
    .venv/bin/speedkv measure prefix-ttft --url http://127.0.0.1:8011

A run tag opens the document, so a rerun against the same server starts cold again.
"""

from __future__ import annotations

import argparse
import time

import httpx

from speedkv.prompts.haystack import sentence_pool

CHARS_PER_TOKEN = 4.7  # the essays under SmolLM2's tokenizer, roughly
QUESTIONS = ("Who wrote this text?", "What is its main idea?")


def document(tokens: int) -> str:
    """Essay sentences in order, about `tokens` tokens long, opened by a run tag."""
    text, sentences = f"(run {time.time_ns()})", iter(sentence_pool())
    while len(text) < tokens * CHARS_PER_TOKEN:
        text += " " + next(sentences)
    return text


def ask(client: httpx.Client, model: str, text: str, question: str, method: str) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": text}, {"role": "user", "content": question}],
        "max_tokens": 1,
        "temperature": 0,
        "speedkv": {"method": method},
    }
    response = client.post("/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="speedkv measure prefix-ttft", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=4000, help="Document length, about.")
    parser.add_argument("--methods", default="full;speed:lcut=22,anchors=bos,deep=1")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    text = document(args.tokens)
    print("| method | prompt tokens | TTFT first s | TTFT second s | second/first | reused |")
    print("|---|---|---|---|---|---|")
    with httpx.Client(base_url=args.url, headers=headers, timeout=600) as client:
        for method in args.methods.split(";"):
            first, second = (ask(client, args.model, text, q, method) for q in QUESTIONS)
            ttfts = [answer["speedkv"][0]["ttft_s"] for answer in (first, second)]
            reused = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            print(
                f"| `{method}` | {first['usage']['prompt_tokens']} | {ttfts[0]:.2f} "
                f"| {ttfts[1]:.3f} | {ttfts[1] / ttfts[0]:.3f} | {reused} |"
            )


if __name__ == "__main__":
    main()
