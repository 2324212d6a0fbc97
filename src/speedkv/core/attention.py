"""Attention kernels for the engine's prefill chunks and decode steps.

Both go through torch's scaled_dot_product_attention, which on CPU and GPU has fused kernels
that never materialise the full score matrix; grouped-query heads are handled by the kernel
(`enable_gqa`) instead of copying K/V per query head.
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
    head are packed as rows of one query block, which the CPU kernels run several times
    faster than a grouped-query call with a single row.
    """
    heads, kv_heads = q.shape[0], k.shape[0]
    packed = q.reshape(1, kv_heads, heads // kv_heads, q.shape[-1])
    out = F.scaled_dot_product_attention(packed, k[None], v[None])
    return out.reshape(heads, 1, q.shape[-1])
