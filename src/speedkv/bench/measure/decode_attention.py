"""Decode attention alone: milliseconds per layer and cache read rate, by kernel, batch size
and cache length.

    .venv/bin/speedkv measure decode-attention --lengths 1024,2048,4096,8128 --batches 1,8,32

One query token per sequence (SmolLM2's shape by default: 9 query heads over 3 KV heads of 64)
over a bfloat16 cache held as the engine holds it, a view into a buffer with room left. Each
(length, batch) gets 30 layers of caches, cycled so reads come from memory, not the CPU's
caches; the kernels take turns, and each row is the median of the rounds. Kernels:

- `native`: speedkv's C++ kernel, the whole batch in one call (kernels/csrc);
- `fused`: torch's fused attention on the packed queries, one call per sequence;
- `matmul`: one matrix product per KV head for scores and output, per sequence;
- `bmm`: two batched matrix products around a float32 softmax, per sequence (torch copies
  the strided view first).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from speedkv.kernels.attention import fused_decode_attention, matmul_decode_attention
from speedkv.kernels.native import native_ops


def bmm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    heads, kv_heads, dim = q.shape[0], k.shape[0], q.shape[-1]
    scores = torch.bmm(q.reshape(kv_heads, heads // kv_heads, dim), k.transpose(1, 2))
    weights = torch.softmax(scores.float().mul_(dim**-0.5), dim=-1).to(v.dtype)
    return torch.bmm(weights, v).reshape(heads, 1, dim)


def per_sequence(kernel):
    def run(q: torch.Tensor, keys: list, values: list) -> None:
        for b, (k, v) in enumerate(zip(keys, values)):
            kernel(q[b], k, v)

    return run


def native(q: torch.Tensor, keys: list, values: list) -> None:
    batch, heads, _, dim = q.shape
    native_ops().decode_attention(q.reshape(batch, heads, dim), keys, values, dim**-0.5)


KERNELS = {
    "native": native,
    "fused": per_sequence(fused_decode_attention),
    "matmul": per_sequence(matmul_decode_attention),
    "bmm": per_sequence(bmm),
}


def layer_caches(n: int, batch: int, args) -> list[tuple[list, list]]:
    """Per layer, every sequence's keys and values: views into buffers with room left."""
    shape = (args.kv_heads, n + args.room, args.head_dim)

    def view() -> torch.Tensor:
        return torch.randn(shape, dtype=torch.bfloat16)[:, :n]

    return [
        ([view() for _ in range(batch)], [view() for _ in range(batch)]) for _ in range(args.layers)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="speedkv measure decode-attention", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--lengths", default="1024,2048,4096,8128")
    parser.add_argument("--batches", default="1", help="sequences per step, e.g. 1,8,32")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--room", type=int, default=128, help="spare rows in each cache buffer")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = args.kernels.split(",")
    if "native" in kernels and native_ops() is None:
        parser.error("the native kernel is not available here (see the warning above)")
    print(f"torch threads: {torch.get_num_threads()}")
    print("| tokens | batch | kernel | ms per layer | cache GB/s |")
    print("|---:|---:|---|---:|---:|")
    for n in (int(x) for x in args.lengths.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            layers = layer_caches(n, batch, args)
            q = torch.randn(batch, args.heads, 1, args.head_dim, dtype=torch.bfloat16)
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for _ in range(args.rounds):
                for name in kernels:
                    start = time.perf_counter()
                    for keys, values in layers:
                        KERNELS[name](q, keys, values)
                    times[name].append((time.perf_counter() - start) / len(layers))
            cache_bytes = batch * 2 * layers[0][0][0].numel() * 2
            for name in kernels:
                seconds = statistics.median(times[name])
                print(
                    f"| {n} | {batch} | {name} | {seconds * 1e3:.3f} "
                    f"| {cache_bytes / seconds / 1e9:.1f} |"
                )
            del layers


if __name__ == "__main__":
    main()
