#!/usr/bin/env python3
"""vLLM's prefix caching with SPEED, measured against stock vLLM's: what a cached document saves
in TTFT, and how many cached documents one KV pool keeps.

Run it with the interpreter of the environment that has vLLM and speedkv (`make vllm-venv`),
with nothing else on the CPU (the TTFT part times):

    .venv-vllm/bin/python benchmarks/vllm_prefix_cache.py --out benchmarks/vllm/prefix-cache.json

For each method (stock vLLM is `full`), one engine with prefix caching on:

- **TTFT.** Each of `--questions` questions of 30 tokens on a document of `--doc-tokens` tokens
  is asked twice, back to back, in alternating order: from scratch (vLLM's prefix cache reset),
  and over the document cached by another question just before. TTFT is that of a one-token
  generation, timed as speedkv times vLLM (speedkv.vllm.timing: vLLM's own first-token
  latency); every ratio is taken within its pair.
- **Resident documents.** A fresh engine with a pool of `--pool-stock-blocks` stock blocks (the
  same bytes for every method) is sent `--documents` distinct documents, one after another,
  each with a question. Then vLLM's own prefix lookup (no request is run) says which of them
  are still cached whole: those stay resident and would be served from the cache.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

from vllm_capacity import BLOCK, in_process_vllm, stock_pool_bytes, write_record


def build(method: str, args, **options):
    from vllm import LLM

    from speedkv.vllm.args import engine_args

    # disable_log_stats=False: vLLM keeps the request metrics TTFT is read from
    settings = dict(dtype=args.dtype, seed=0, enable_prefix_caching=True, block_size=BLOCK,
                    max_model_len=args.doc_tokens + 256, disable_log_stats=False)  # fmt: skip
    return LLM(model=str(args.directory), **{**settings, **engine_args(method, args.directory),
                                              **options})  # fmt: skip


def close(llm) -> None:
    from speedkv.vllm.offline import shut_down

    shut_down(llm)
    del llm
    gc.collect()


def first_token(llm, ids: list[int]) -> tuple[float, int]:
    """Seconds to the first token of `ids` (TTFT as speedkv times vLLM, the wall time of the
    call where vLLM kept no metrics), and the prompt tokens vLLM took from its cache."""
    from vllm import SamplingParams

    from speedkv.vllm.timing import request_times, timed_generate

    once = SamplingParams(temperature=0.0, max_tokens=1)
    wall, (out,) = timed_generate(llm, [ids], once)
    times = request_times(out)
    return times.ttft_s if times else wall, int(out.num_cached_tokens or 0)


def measure_ttft(method: str, args, doc: list[int], questions: list[list[int]]) -> dict:
    llm = build(method, args, kv_cache_memory_bytes=2**30)
    try:
        first_token(llm, doc + questions[0])  # warms up
        pairs = []
        for i, question in enumerate(questions[1:]):
            ids = doc + question
            order = ["cached", "scratch"] if i % 2 == 0 else ["scratch", "cached"]
            got = {}
            for kind in order:
                llm.reset_prefix_cache()
                if kind == "cached":  # another question caches the document
                    first_token(llm, doc + questions[0])
                got[kind] = first_token(llm, ids)
            pairs.append(got)
            print(f"[prefix-cache] {method} question {i + 1}: cached {got['cached'][0]:.3f} s "
                  f"({got['cached'][1]} tokens reused), scratch {got['scratch'][0]:.3f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
        ratios = [p["cached"][0] / p["scratch"][0] for p in pairs]
        return {
            "method": method,
            "ttft_cached_s": statistics.median(p["cached"][0] for p in pairs),
            "ttft_scratch_s": statistics.median(p["scratch"][0] for p in pairs),
            "reused_tokens": [p["cached"][1] for p in pairs],
            "cached_over_scratch": statistics.median(ratios),
            "ratios": ratios,
        }
    finally:
        close(llm)


def measure_resident(method: str, args, docs: list[list[int]], question: list[int]) -> dict:
    pool = stock_pool_bytes(args.directory, args.dtype, args.pool_stock_blocks)
    llm = build(method, args, kv_cache_memory_bytes=pool, enforce_eager=True)
    try:
        from vllm import SamplingParams

        engine = llm.llm_engine
        scheduler = engine.engine_core.engine_core.scheduler
        sampling = SamplingParams(temperature=0.0, max_tokens=1)
        requests = []  # each document's request, kept for its block hashes
        add = scheduler.add_request
        scheduler.add_request = lambda request: (requests.append(request), add(request))[1]
        for i, doc in enumerate(docs):
            engine.add_request(f"d{i}", {"prompt_token_ids": doc + question}, sampling)
            while engine.has_unfinished_requests():
                engine.step()
        coordinator = scheduler.kv_cache_manager.coordinator
        whole = len(docs[0]) // BLOCK * BLOCK
        hits = [coordinator.find_longest_cache_hit(r.block_hashes, r.num_tokens - 1)[1]
                for r in requests]  # fmt: skip
        resident = [i for i, hit in enumerate(hits) if hit >= whole]
        return {
            "method": method,
            "pool_bytes": pool,
            "num_blocks": scheduler.kv_cache_config.num_blocks,
            "groups": [len(g.layer_names) for g in scheduler.kv_cache_config.kv_cache_groups],
            "hits": hits,
            "resident_documents": len(resident),
            "resident": resident,
        }
    finally:
        close(llm)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default="full;speed:lcut=15,anchors=bos;speed")
    p.add_argument("--doc-tokens", type=int, default=4096)
    p.add_argument("--questions", type=int, default=6, help="timed pairs, after one warm-up")
    p.add_argument("--documents", type=int, default=16)
    p.add_argument("--pool-stock-blocks", type=int, default=200,
                   help="the resident pool, in blocks of the stock model (128 tokens in every "
                   "layer): 200 hold six 4K documents of stock vLLM")  # fmt: skip
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--skip", choices=["ttft", "resident"], help="leave one part out")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    in_process_vllm()
    from speedkv.bench.machine import machine_facts
    from speedkv.hf.loading import load_tokenizer, model_directory
    from speedkv.prompts.builders import exact_chat_prompt

    args.directory = model_directory(args.model, progress=False)
    tokenizer = load_tokenizer(args.directory)
    methods = [m.strip() for m in args.methods.split(";") if m.strip()]
    doc = exact_chat_prompt(tokenizer, args.doc_tokens, start=7)
    # questions of 30 tokens: a user turn of their own, without the BoS
    questions = [exact_chat_prompt(tokenizer, 31, start=500 + 40 * i)[1:]
                 for i in range(args.questions + 1)]  # fmt: skip
    record = {
        "command": " ".join([".venv-vllm/bin/python benchmarks/vllm_prefix_cache.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "model": args.model, "dtype": args.dtype, "doc_tokens": args.doc_tokens,
        "question_tokens": len(questions[0]), "machine": machine_facts(),
    }  # fmt: skip
    if args.skip != "ttft":
        record["ttft"] = [measure_ttft(m, args, doc, questions) for m in methods]
    if args.skip != "resident":
        docs = [exact_chat_prompt(tokenizer, args.doc_tokens, start=1000 + 97 * i)
                for i in range(args.documents)]  # fmt: skip
        runs = [measure_resident(m, args, docs, questions[0]) for m in methods]
        stock = next((r for r in runs if r["method"] == "full"), None)
        for run in runs:
            if stock and stock["resident_documents"]:
                run["vs_stock"] = run["resident_documents"] / stock["resident_documents"]
        record["resident"] = runs
    write_record(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
