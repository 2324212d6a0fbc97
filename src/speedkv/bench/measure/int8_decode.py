"""Weight-only int8 against the model's native weights, in one process: TTFT and TPOT of the
same prompts under each, turn about (speedkv.bench.paired), so the ratios are same-run figures.

    .venv/bin/speedkv measure int8-decode --lengths 2048,4096 --repeats 3 [--prepack]

Prints a markdown table: medians per method, length and weights, and int8 / native ratios.
"""

from __future__ import annotations

import argparse
import functools
import statistics

from speedkv import Engine, Request, SamplingParams, load_model
from speedkv.bench.paired import turn_about
from speedkv.hf.loading import quantize_int8
from speedkv.prompts.builders import chat_document


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="speedkv measure int8-decode", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--methods", default="full;speed:lcut=22,anchors=bos,deep=1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--prepack", action="store_true", help="both decode prepacked, as the CLI does"
    )
    args = parser.parse_args(argv)
    native = load_model("smollm2-135m", dtype=args.dtype, progress=False)
    # --prepack: both decode through a packed copy of their weights, as the CLI does (speedkv's
    # kernel where the CPU has AVX512-BF16, else oneDNN's for native weights)
    engines = {
        "native": Engine(native, prepack=args.prepack),
        "int8": Engine(quantize_int8(native), prepack=args.prepack),
    }
    lengths = [int(n) for n in args.lengths.split(",")]
    methods = args.methods.split(";")
    sampling = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    print(
        "| method | tokens | TTFT native s | TTFT int8 s | TPOT native ms | TPOT int8 ms "
        "| TTFT int8/native | TPOT int8/native |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")

    def run(weights: str, ids: list[int], method: str):
        engine = engines[weights]
        return engine.generate([Request(ids, engine.policy(method), sampling)])[0]

    for method in methods:
        for n in lengths:
            ids = native.tokenizer(chat_document(native.tokenizer, n))["input_ids"][:n]
            # one warm-up round, then the two weights in turn, round by round
            arms = {w: functools.partial(run, w, ids, method) for w in engines}
            done = turn_about(arms, args.repeats)
            ttft = done.ratio("int8", "native", "ttft_s").median
            tpot = done.ratio("int8", "native", "tpot_s").median
            a, b = done.results["native"], done.results["int8"]
            print(
                f"| `{method}` | {n} | {statistics.median(g.ttft_s for g in a):.3f} | "
                f"{statistics.median(g.ttft_s for g in b):.3f} | "
                f"{1000 * statistics.median(g.tpot_s for g in a):.1f} | "
                f"{1000 * statistics.median(g.tpot_s for g in b):.1f} | {ttft:.3f} | {tpot:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
