"""Weight-only int8 against the model's native weights, in one process: TTFT and TPOT of the
same prompts under each, alternating, so the ratios are same-run figures.

    .venv/bin/python benchmarks/int8_decode.py --lengths 2048,4096 --repeats 3 [--prepack]

Prints a markdown table: medians per method, length and weights, and int8 / native ratios.
"""

from __future__ import annotations

import argparse
import statistics

from speedkv import Engine, Request, SamplingParams, load_model
from speedkv.hf.loading import quantize_int8
from speedkv.prompts.builders import chat_document


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--methods", default="full;speed:lcut=22,anchors=bos,deep=1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--prepack", action="store_true", help="both decode prepacked, as the CLI does"
    )
    args = parser.parse_args()
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
    times: dict[tuple, list[tuple[float, float]]] = {}
    for repeat in range(args.repeats + 1):  # the first round warms up and is not counted
        for n in lengths:
            ids = native.tokenizer(chat_document(native.tokenizer, n))["input_ids"][:n]
            for method in methods:
                order = ["native", "int8"] if repeat % 2 == 0 else ["int8", "native"]
                for weights in order:
                    engine = engines[weights]
                    request = Request(ids, engine.policy(method), sampling)
                    g = engine.generate([request])[0]
                    if repeat:
                        times.setdefault((method, n, weights), []).append((g.ttft_s, g.tpot_s))
    print(
        "| method | tokens | TTFT native s | TTFT int8 s | TPOT native ms | TPOT int8 ms "
        "| TTFT int8/native | TPOT int8/native |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for method in methods:
        for n in lengths:
            a, b = times[(method, n, "native")], times[(method, n, "int8")]
            ttft = statistics.median(y[0] / x[0] for x, y in zip(a, b))
            tpot = statistics.median(y[1] / x[1] for x, y in zip(a, b))
            print(
                f"| `{method}` | {n} | {statistics.median(x[0] for x in a):.3f} | "
                f"{statistics.median(x[0] for x in b):.3f} | "
                f"{1000 * statistics.median(x[1] for x in a):.1f} | "
                f"{1000 * statistics.median(x[1] for x in b):.1f} | {ttft:.3f} | {tpot:.3f} |"
            )


if __name__ == "__main__":
    main()
