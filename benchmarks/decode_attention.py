"""Decode attention alone: milliseconds per layer and cache read rate, by kernel and cache length.

    .venv/bin/python benchmarks/decode_attention.py --lengths 1024,2048,4096,8128

One query token (SmolLM2's shape by default: 9 query heads over 3 KV heads of 64) over a
bfloat16 cache held as the engine holds it, a view into a buffer with room left. Each length
gets 30 caches, one per layer, cycled so reads come from memory, not the CPU's caches; the
kernels take turns, and each row is the median of the rounds. Kernels:

- `engine`: speedkv's `decode_attention` as it is on the path (the next two, by length);
- `fused`: torch's fused attention on the packed queries;
- `matmul`: one matrix product per KV head for scores and output;
- `bmm`: two batched matrix products around a float32 softmax (torch copies the view first);
- `bmm-contiguous`: the same on a contiguous copy of the cache, the rate a batched product
  could reach if the live cache were one block.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from speedkv.core.attention import (
    decode_attention,
    fused_decode_attention,
    matmul_decode_attention,
)


def bmm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    heads, kv_heads, dim = q.shape[0], k.shape[0], q.shape[-1]
    scores = torch.bmm(q.reshape(kv_heads, heads // kv_heads, dim), k.transpose(1, 2))
    weights = torch.softmax(scores.float().mul_(dim**-0.5), dim=-1).to(v.dtype)
    return torch.bmm(weights, v).reshape(heads, 1, dim)


KERNELS = {
    "engine": decode_attention,
    "fused": fused_decode_attention,
    "matmul": matmul_decode_attention,
    "bmm": bmm,
    "bmm-contiguous": bmm,
}


def caches(n: int, args, contiguous: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    room = 0 if contiguous else args.room
    shape = (args.kv_heads, n + room, args.head_dim)
    return [
        (
            torch.randn(shape, dtype=torch.bfloat16)[:, :n],
            torch.randn(shape, dtype=torch.bfloat16)[:, :n],
        )
        for _ in range(args.layers)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8128")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--room", type=int, default=128, help="spare rows in each cache buffer")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = args.kernels.split(",")
    print("| tokens | kernel | ms per layer | cache GB/s |")
    print("|---:|---|---:|---:|")
    for n in (int(x) for x in args.lengths.split(",")):
        strided = caches(n, args, contiguous=False)
        contiguous = [(k.contiguous(), v.contiguous()) for k, v in strided]
        q = torch.randn(args.heads, 1, args.head_dim, dtype=torch.bfloat16)
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(args.rounds):
            for name in kernels:
                layers = contiguous if name == "bmm-contiguous" else strided
                start = time.perf_counter()
                for k, v in layers:
                    KERNELS[name](q, k, v)
                times[name].append((time.perf_counter() - start) / len(layers))
        cache_bytes = 2 * strided[0][0].numel() * 2
        for name in kernels:
            seconds = statistics.median(times[name])
            print(f"| {n} | {name} | {seconds * 1e3:.3f} | {cache_bytes / seconds / 1e9:.1f} |")


if __name__ == "__main__":
    main()
