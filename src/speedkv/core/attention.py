"""Attention kernels for the engine's prefill chunks and decode steps.

Both go through torch's scaled_dot_product_attention, which on CPU and GPU has fused kernels
that never materialise the full score matrix; grouped-query heads are handled by the kernel
(`enable_gqa`) instead of copying K/V per query head. The exception is decode over a long
cache on a CPU, where plain matrix products read the cache faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of a chunk of queries over the keys before and including them.

    q: [Hq, n_q, D]; k, v: [Hkv, n_k, D] with n_k >= n_q, the queries being the last n_q keys.
    mask: optional bool [n_q, n_k] (True = visible) replacing the causal rule.
    Returns [Hq, n_q, D].
    """
    n_q, n_k = q.shape[1], k.shape[1]
    kwargs = {"enable_gqa": q.shape[0] != k.shape[0]}
    if mask is not None:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, **kwargs)
    elif n_q == n_k:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, **kwargs)
    else:
        bias = causal_lower_right(n_q, n_k)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=bias, **kwargs)
    return out[0]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query token over every cached entry (all earlier, so no mask).

    q: [Hq, 1, D]; k, v: [Hkv, n, D]. Returns [Hq, 1, D]. The query heads that share a KV
    head are packed as the rows of one query block, which the CPU kernels run several times
    faster than a grouped-query call with a single row. Long caches on a CPU go through
    matrix products instead of the fused kernel (`_matmul_decode_attention`).
    """
    heads, kv_heads, dim = q.shape[0], k.shape[0], q.shape[-1]
    if k.device.type == "cpu" and k.shape[1] >= MATMUL_FROM:
        return _matmul_decode_attention(q.reshape(kv_heads, heads // kv_heads, dim), k, v)
    packed = q.reshape(1, kv_heads, heads // kv_heads, dim)
    return F.scaled_dot_product_attention(packed, k[None], v[None]).reshape(heads, 1, dim)


# Cache length from which decode attention on a CPU runs as matrix products. torch's CPU
# attention kernel parallelises over heads, and reads a long cache at 5-7 GB/s with SmolLM2's
# 3 KV heads on 2 cores; matrix products per KV head read it about twice as fast at 8K tokens
# (and as fast at 2K; slower at 1K). Measured with benchmarks/decode_breakdown.py.
MATMUL_FROM = 2048


def _matmul_decode_attention(
    packed: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """Packed queries [Hkv, G, D] over k, v [Hkv, n, D]: scores and output as one matrix
    product per KV head, the softmax in float32 between them (HF's eager rounding: scores and
    weights in the cache's dtype). One product per head, because the cache is a view into a
    buffer with room left, which a batched product would first copy whole."""
    kv_heads, group, dim = packed.shape
    scores = torch.empty((kv_heads, group, k.shape[1]), dtype=k.dtype, device=k.device)
    for head in range(kv_heads):
        torch.mm(packed[head], k[head].t(), out=scores[head])
    weights = torch.softmax(scores.float().mul_(dim**-0.5), dim=-1).to(v.dtype)
    out = torch.empty_like(packed)
    for head in range(kv_heads):
        torch.mm(weights[head], v[head], out=out[head])
    return out.reshape(kv_heads * group, 1, dim)
