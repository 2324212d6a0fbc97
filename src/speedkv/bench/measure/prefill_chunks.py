"""TTFT of one prefill at several chunk sizes, turn about in one process (on a CPU whose speed
drifts within minutes, only paired rounds compare: speedkv.bench.paired): SmolLM2 in bfloat16
on prepacked weights, `full` and SPEED-22, the median over rounds of each chunk size's TTFT over
the first's.

    speedkv measure prefill-chunks --lengths 2048,8128 --chunks 1024,2048 --rounds 6
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from speedkv import Engine, Request, SamplingParams, load_model
from speedkv.bench.paired import turn_about
from speedkv.prompts.builders import exact_chat_prompt

METHODS = {"full": "full", "SPEED-22": "speed:lcut=22,anchors=bos"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="speedkv measure prefill-chunks", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--lengths", default="2048,8128", help="prompt lengths in tokens")
    parser.add_argument("--chunks", default="1024,2048", help="chunk sizes; the first is the base")
    parser.add_argument("--rounds", type=int, default=6, help="turns of every chunk size")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    chunks = [int(c) for c in args.chunks.split(",")]
    model = load_model("smollm2-135m", dtype="bfloat16", progress=False)
    engines = {c: Engine(model, chunk_size=c, prepack=True) for c in chunks}
    one_token = SamplingParams(max_new_tokens=1, ignore_eos=True)
    print("| tokens | method | " + " | ".join(f"TTFT s, chunks of {c}" for c in chunks)
          + " | " + " | ".join(f"{c} / {chunks[0]}" for c in chunks[1:]) + " |")  # fmt: skip
    print("|---:|---|" + "---:|" * (2 * len(chunks) - 1))

    def first_token(chunk: int, ids: list[int], spec: str):
        engine = engines[chunk]
        return engine.generate([Request(ids, engine.policy(spec), one_token)])[0]

    for length in (int(n) for n in args.lengths.split(",")):
        ids = exact_chat_prompt(model.tokenizer, length)
        for name, spec in METHODS.items():
            # one warm-up round, then every chunk size in turn, round by round
            arms = {c: functools.partial(first_token, c, ids, spec) for c in chunks}
            done = turn_about(arms, args.rounds)
            medians = [f"{statistics.median(done.figures(c, 'ttft_s')):.3f}" for c in chunks]
            ratios = [f"{done.ratio(c, chunks[0], 'ttft_s').median:.3f}" for c in chunks[1:]]
            print(f"| {length} | {name} | " + " | ".join(medians + ratios) + " |", flush=True)


if __name__ == "__main__":
    main()
