"""A decode step's weight products alone: milliseconds per step and weight read rate, by
kernel and batch size.

    .venv/bin/speedkv measure decode-linear --batches 1,8,32

The 121 products of one SmolLM2 step (30 layers of stacked q/k/v, output, stacked gate/up and
down projections, then the LM head), random bfloat16 weights, 269 MB in all: far more than
the CPU's caches, so every step reads them from memory as a real step does. The kernels take
turns; each row is the median of the rounds. Kernels:

- `native`: speedkv's kernel on the CPU's bfloat16 dot-product instruction (AVX512-BF16), or
  on AVX2's float32 multiply-adds, weights packed in its own layout
  (kernels/csrc/decode_linear.cpp); what `--prepack` runs on such CPUs;
- `onednn`: oneDNN's kernel on weights prepacked in its blocked layout (torch's
  `mkldnn._linear_pointwise`); left out where oneDNN takes no bfloat16 (AVX2-only CPUs);
- `float32`: the same weights in float32 on oneDNN's prepacked layout, with float32 inputs:
  what `--dtype auto` decodes on where the CPU has neither AVX512-BF16 nor AMX;
- `plain`: torch's `F.linear` on the weights as loaded;
- `native-int8`: the weights as int8 rows with one scale per output (`--weights int8`) in
  speedkv's layout, the same kernel widening them to bfloat16 in registers;
- `torch-int8`: the same int8 rows through torch's `_weight_int8pack_mm`.

Weight GB/s counts the bytes each kernel reads: half as many for the int8 ones, twice as
many for float32.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from speedkv.hf.int8 import Int8Linear
from speedkv.kernels import linear
from speedkv.kernels.native import has_linear_kernel, native_ops

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [out, in]
HEAD_SHAPE = (49152, 576)
# bytes each kernel reads per bfloat16 weight byte
BYTES_READ = {"float32": 2, "native-int8": 0.5, "torch-int8": 0.5}


def _as_linear(weight: torch.Tensor) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    layer.weight.data = weight
    return layer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="speedkv measure decode-linear", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--batches", default="1,8,32", help="rows per product (sequences)")
    parser.add_argument(
        "--kernels",
        default="native,onednn,float32,plain,native-int8,torch-int8",
        help="comma-separated; onednn is left out where oneDNN takes no bfloat16",
    )
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = args.kernels.split(",")
    if not linear.onednn_bf16() and "onednn" in kernels:
        print("oneDNN takes no bfloat16 weights on this CPU: its row is left out")
        kernels.remove("onednn")
    ops = native_ops()
    if "native" in kernels and not has_linear_kernel(ops):
        parser.error("the native linear kernel is not available here (no compiler?)")
    shapes = LAYER_SHAPES * args.layers + [HEAD_SHAPE]
    plain = [(torch.randn(shape).bfloat16(), None) for shape in shapes]
    int8 = [Int8Linear(_as_linear(w)).tensors() for w, _ in plain] if "int8" in args.kernels else []
    weights = {
        "plain": plain,
        "onednn": [linear.prepacked(w) for w in plain] if "onednn" in kernels else [],
        "float32": [linear.prepacked((w.float(), None)) for w, _ in plain]
        if "float32" in kernels
        else [],
        "native": [linear.prepacked(w, ops) for w in plain] if "native" in kernels else [],
        "native-int8": [linear.prepacked(t, ops) for t in int8] if "native-int8" in kernels else [],
        "torch-int8": int8,
    }
    total = sum(w.numel() * w.element_size() for w, _ in plain)
    print(f"torch threads: {torch.get_num_threads()}; {total / 1e6:.0f} MB of weights a step")
    print("| batch | kernel | ms per step | weight GB/s |")
    print("|---:|---|---:|---:|")
    for batch in (int(b) for b in args.batches.split(",")):
        inputs = {k: torch.randn(batch, 1, k).bfloat16() for k in {s[1] for s in shapes}}
        wide = {k: x.float() for k, x in inputs.items()}

        def step(kernel: str, inputs: dict = inputs, wide: dict = wide) -> None:
            for (_, width), tensors in zip(shapes, weights[kernel]):
                if kernel == "plain":
                    F.linear(inputs[width], *tensors)
                else:
                    x = wide[width] if kernel == "float32" else inputs[width]
                    linear.apply_linear(x, tensors)

        times: dict[str, list[float]] = {k: [] for k in kernels}
        for kernel in kernels:
            step(kernel)  # warm-up
        for _ in range(args.rounds):
            for kernel in kernels:
                start = time.perf_counter()
                step(kernel)
                times[kernel].append(time.perf_counter() - start)
        for kernel in kernels:
            seconds = statistics.median(times[kernel])
            read = total * BYTES_READ.get(kernel, 1)
            print(f"| {batch} | {kernel} | {seconds * 1e3:.2f} | {read / seconds / 1e9:.1f} |")


if __name__ == "__main__":
    main()
