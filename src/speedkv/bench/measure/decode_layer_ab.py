"""Decode with each layer in one native call against the same layers in parts, turn about.

    .venv/bin/speedkv measure decode-layer-ab --lengths 2048,8128 --rounds 4

One engine, one process: for each prompt length and method, generates the same request
`--rounds` times with the layers in one call (kernels/csrc/decode_layer.cpp) and as many times
in parts (the Python path, which makes the same kernel calls one by one), alternating which
goes first (speedkv.bench.paired), and prints each side's TPOT and the median of the rounds'
ratios. Pairing the rounds sheds most of a noisy machine's drift. Both sides decode the same
tokens: the script checks it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from contextlib import contextmanager

import torch

from speedkv import Engine, Request, SamplingParams, load_model
from speedkv.bench.paired import turn_about
from speedkv.hf.backbone import Backbone
from speedkv.prompts.builders import exact_chat_prompt


@contextmanager
def layers_in_parts():
    """Within it, decode steps run their layers in parts."""
    one_call = Backbone.layers_in_one_call
    Backbone.layers_in_one_call = lambda self, rows: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        Backbone.layers_in_one_call = one_call  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="speedkv measure decode-layer-ab", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="2048,8128", help="prompt tokens, comma-separated")
    parser.add_argument("--methods", default="full;speed:lcut=22,anchors=bos,deep=1",
                        help="methods, ';'-separated")  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype="bfloat16", progress=False)
    engine = Engine(model, prepack=True)
    model.backbone.check_weights()  # gathers and packs the weights (else the first prefill)
    if not model.backbone.layers_in_one_call(1):
        raise SystemExit("no decode layer in one call here: its native kernels are not all built")
    sampling = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    print("| method | tokens | TPOT one call ms | TPOT in parts ms | one call / in parts |")
    print("|---|---:|---:|---:|---:|")

    def one_call(request: Request):
        return engine.generate([request])[0]

    def in_parts(request: Request):
        with layers_in_parts():
            return engine.generate([request])[0]

    for length in (int(n) for n in args.lengths.split(",")):
        ids = exact_chat_prompt(model.tokenizer, length)
        for method in args.methods.split(";"):
            request = Request(ids, engine.policy(method), sampling)
            # one warm-up round, then the two paths in turn, round by round
            arms = {"one call": functools.partial(one_call, request),
                    "in parts": functools.partial(in_parts, request)}  # fmt: skip
            done = turn_about(arms, args.rounds)
            first = {side: done.results[side][0].output_ids for side in arms}
            if first["one call"] != first["in parts"]:
                raise SystemExit(f"{method} at {length}: the two paths decoded different tokens")
            tpot = {side: done.figures(side, lambda g: 1000 * g.tpot_s) for side in arms}
            ratio = done.ratio("one call", "in parts", "tpot_s").median
            print(
                f"| `{method}` | {length} | {statistics.median(tpot['one call']):.1f} "
                f"| {statistics.median(tpot['in parts']):.1f} | {ratio:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
