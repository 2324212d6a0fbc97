"""Causal prefill attention alone: milliseconds per layer and TFLOP/s, speedkv's bfloat16
kernel against torch's, by prompt length.

    .venv/bin/speedkv measure prefill-attention --lengths 512,2048,8192

One layer's causal attention over a whole prompt (SmolLM2's shape by default: 9 query heads
over 3 KV heads of 64), bfloat16, with the queries as the engine holds them (a transposed
view) and the keys and values as views into a cache buffer. The kernels take turns; each row
is the median of the rounds. FLOPs count the causal half only: 2 products of 2 * D
operations per query-key pair, n (n + 1) / 2 pairs per query head. Kernels:

- `native`: speedkv's C++ kernel on the CPU's bfloat16 dot-product instruction (kernels/csrc);
- `torch`: torch's scaled_dot_product_attention, causal, grouped-query heads in the kernel.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from speedkv.kernels.native import has_prefill_kernel, native_ops


def native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return native_ops().causal_attention(q, k, v, q.shape[-1] ** -0.5)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], is_causal=True, enable_gqa=q.shape[0] != k.shape[0]
    )[0]


KERNELS = {"native": native, "torch": sdpa}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="speedkv measure prefill-attention", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = args.kernels.split(",")
    if "native" in kernels and not has_prefill_kernel(native_ops()):
        parser.error("the native prefill kernel is not available here (no AVX512-BF16?)")
    print(f"torch threads: {torch.get_num_threads()}")
    print("| tokens | kernel | ms per layer | TFLOP/s | x torch |")
    print("|---:|---|---:|---:|---:|")
    for n in (int(x) for x in args.lengths.split(",")):
        q = torch.randn(n, args.heads, args.head_dim, dtype=torch.bfloat16).transpose(0, 1)
        k = torch.randn(args.kv_heads, n + 128, args.head_dim, dtype=torch.bfloat16)[:, :n]
        v = torch.randn(args.kv_heads, n + 128, args.head_dim, dtype=torch.bfloat16)[:, :n]
        flops = 4 * args.head_dim * args.heads * n * (n + 1) / 2
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for name in kernels:  # warm-up: allocations, the first call's setup
            KERNELS[name](q, k, v)
        for _ in range(args.rounds):
            for name in kernels:
                start = time.perf_counter()
                KERNELS[name](q, k, v)
                times[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(t) for name, t in times.items()}
        for name in kernels:
            speedup = medians["torch"] / medians[name] if "torch" in medians else float("nan")
            print(
                f"| {n} | {name} | {medians[name] * 1e3:.2f} | {flops / medians[name] / 1e12:.3f} "
                f"| {speedup:.2f} |"
            )


if __name__ == "__main__":
    main()
