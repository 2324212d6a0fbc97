#!/usr/bin/env python3
"""How many long requests fit one vLLM KV pool: stock vLLM against SPEED, whose upper layers
hold blocks for their full-depth rows only.

Run it with the interpreter of the environment that has vLLM and speedkv (`make vllm-venv`):

    .venv-vllm/bin/python benchmarks/vllm_capacity.py --out benchmarks/vllm/capacity.json

Every method gets the same pool, in bytes: `--pool-stock-blocks` blocks of the stock model (each
block is 128 tokens in every layer). All requests arrive at once, each a distinct chat prompt of
`--prompt-tokens` tokens, and each generates `--new-tokens` tokens. The scheduler admits a
request only while its blocks fit, so the most requests running at once is the capacity.
Reported per method:
- the KV cache groups vLLM made,
- the blocks each group holds for one request during decode (from vLLM's own KV manager),
- the most requests running at once, and the preemptions,
- the greedy tokens (float32), which must not depend on how blocks are allocated.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

BLOCK = 128  # vLLM's block size on the CPU, in tokens


def in_process_vllm() -> None:
    """vLLM's engine core in this process, its scheduler in reach, quiet, and no KV space of
    its own (it would override the pool set per engine). Call before vLLM is imported."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def stock_pool_bytes(directory, dtype: str, blocks: int) -> int:
    """The bytes of `blocks` blocks of the stock model: 128 tokens in every layer."""
    import torch

    from speedkv.vllm.args import model_shape

    shape = model_shape(directory)
    return blocks * BLOCK * shape.kv_bytes_per_token_layer(getattr(torch, dtype)) * shape.num_layers


def write_record(record: dict, out: Path | None) -> None:
    """Print a run's record as JSON, and write it to `out` when given."""
    text = json.dumps(record, indent=2)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    print(text)


def measure(method: str, compact: bool, args, prompts) -> dict:
    from vllm import LLM, SamplingParams

    from speedkv.vllm.args import engine_args
    from speedkv.vllm.offline import shut_down

    directory = args.directory
    extra = engine_args(method, directory)
    if "hf_overrides" in extra:
        extra["hf_overrides"]["speedkv_compact_kv"] = compact
    pool = stock_pool_bytes(directory, args.dtype, args.pool_stock_blocks)
    settings = dict(dtype=args.dtype, seed=0, enforce_eager=True, enable_prefix_caching=False,
                    block_size=BLOCK, kv_cache_memory_bytes=pool, max_num_seqs=len(prompts),
                    max_model_len=args.prompt_tokens + args.new_tokens + 8,
                    disable_log_stats=False)  # fmt: skip
    llm = LLM(model=str(directory), **{**settings, **extra})
    try:
        engine = llm.llm_engine
        scheduler = engine.engine_core.engine_core.scheduler
        config = scheduler.kv_cache_config
        groups = [
            {"layers": len(g.layer_names), "spec": type(g.kv_cache_spec).__name__}
            for g in config.kv_cache_groups
        ]
        sampling = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, sampling)
        most, decode_blocks, tokens = 0, None, {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    tokens[output.request_id] = list(output.outputs[0].token_ids)
            most = max(most, len(scheduler.running))
            managers = scheduler.kv_cache_manager.coordinator.single_type_managers
            for request in scheduler.running:
                if decode_blocks is None and request.num_computed_tokens > args.prompt_tokens:
                    decode_blocks = [len(m.req_to_blocks[request.request_id]) for m in managers]
        preemptions = next(
            (int(m.value) for m in llm.get_metrics() if m.name == "vllm:num_preemptions"), 0
        )
        return {
            "method": method,
            "compact_kv": compact if "hf_overrides" in extra else None,
            "pool_bytes": pool,
            "num_blocks": config.num_blocks,
            "groups": groups,
            "decode_blocks_per_group": decode_blocks,
            "max_running": most,
            "preemptions": preemptions,
            "tokens": [tokens[f"r{i}"] for i in range(len(prompts))],
        }
    finally:
        shut_down(llm)
        del llm
        gc.collect()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--methods",
        default="full;speed:lcut=15,anchors=bos,deep=1;speed:lcut=22,anchors=bos,deep=1",
    )
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument(
        "--pool-stock-blocks",
        type=int,
        default=182,
        help="the pool, in blocks of the stock model (182: 1 GiB of float32 KV)",
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)  # fmt: skip

    in_process_vllm()
    from speedkv.bench.machine import machine_facts
    from speedkv.hf.loading import load_tokenizer, model_directory
    from speedkv.prompts.builders import exact_chat_prompt

    args.directory = model_directory(args.model, progress=False)
    tokenizer = load_tokenizer(args.directory)
    prompts = [exact_chat_prompt(tokenizer, args.prompt_tokens, start=31 * i)
               for i in range(args.requests)]  # fmt: skip
    runs = []
    for method in [m.strip() for m in args.methods.split(";") if m.strip()]:
        for compact in [False, True] if method.startswith("speed") else [False]:
            print(f"[capacity] {method} compact_kv={compact}", file=sys.stderr, flush=True)
            runs.append(measure(method, compact, args, prompts))
    stock = next(r for r in runs if r["method"] == "full")
    for run in runs:
        run["capacity_vs_stock"] = run["max_running"] / stock["max_running"]
        same = [r for r in runs if r["method"] == run["method"]]
        run["tokens_same_as_uncompacted"] = all(r["tokens"] == run["tokens"] for r in same)
    record = {
        "command": " ".join([".venv-vllm/bin/python benchmarks/vllm_capacity.py", *sys.argv[1:]]),
        "model": args.model, "prompt_tokens": args.prompt_tokens, "requests": args.requests,
        "new_tokens": args.new_tokens, "dtype": args.dtype,
        "pool_stock_blocks": args.pool_stock_blocks, "machine": machine_facts(), "runs": runs,
    }  # fmt: skip
    write_record(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
