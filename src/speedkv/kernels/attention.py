"""Attention kernels for the engine's prefill chunks and decode steps.

Causal bfloat16 prefill on a CPU with AVX512-BF16 runs speedkv's own flash-style kernel
(kernels/csrc/prefill_attention.cpp). Everything else -- float32, an explicit mask, a GPU, a
CPU without those instructions -- goes through torch's scaled_dot_product_attention, which
also never materialises the full score matrix; grouped-query heads are handled by the kernel
(`enable_gqa`) instead of copying K/V per query head.

A decode step on a CPU runs every sequence of the batch through speedkv's own kernel
(kernels/csrc/decode_attention.cpp) in one call, when it could be built here (kernels/native.py).
Otherwise each sequence attends on its own through torch: on a CPU the fused kernel, or plain
matrix products over long caches, which read the cache faster; on a GPU flash attention for
half-precision caches (the matrix products for float32), chosen over torch's own pick of
backend by measurement (`gpu_decode_attention`).

Sliding windows are applied by the callers, by absolute position: over entries in position
order a window is a run of slots, so every kernel here takes it as a narrower view; otherwise
it is a mask (`visible`), which only the matrix products and torch's masked kernel apply.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from speedkv.kernels.native import has_prefill_kernel
from speedkv.kernels.tuning import engine_kernels


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention of a chunk of queries over the keys before and including them.

    q: [Hq, n_q, D]; k, v: [Hkv, n_k, D] with n_k >= n_q, the queries being the last n_q keys.
    mask: optional bool [n_q, n_k] (True = visible) replacing the causal rule.
    Returns [Hq, n_q, D].
    """
    n_q, n_k = q.shape[1], k.shape[1]
    if mask is None and _native_prefill_fits(q, k, v):
        ops = engine_kernels()
        if has_prefill_kernel(ops):
            return ops.causal_attention(q, k, v, q.shape[-1] ** -0.5)
    kwargs = {"enable_gqa": q.shape[0] != k.shape[0]}
    if mask is not None:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, **kwargs)
    elif n_q == n_k:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, **kwargs)
    else:
        # imported here: the module pulls in torch._dynamo, two seconds of every start
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(n_q, n_k)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=bias, **kwargs)
    return out[0]


def _native_prefill_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the native prefill kernel takes these: bfloat16 on a CPU, a head size its
    registers cover, rows contiguous. float32 stays on torch's kernel, the exact reference."""
    return (
        q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.bfloat16
        and q.shape[-1] in (32, 64, 128)
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    )


def batch_decode_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    visible: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """One query token per sequence over that sequence's cache.

    q: [B, Hq, 1, D]; keys[b], values[b]: [Hkv, n_b, D], any lengths, rows contiguous (views
    into a cache buffer are fine). Returns [B, Hq, 1, D]. `visible[b]`, where given: bool
    [Hkv, n_b], the entries sequence b's query sees (a sliding window over a cache whose
    entries are not in position order); such a sequence attends through masked matrix
    products, which the native kernel does not offer.

    Sequences whose caches the native kernel takes run on it, one call per KV-head count;
    the others on torch's kernels. So a sequence's result does not depend on what shares its
    batch: a method with a cache per query head beside one with a shared cache still leaves
    the latter on the kernel it would have alone.
    """
    ops = engine_kernels() if q.device.type == "cpu" else None
    batch, heads, _, dim = q.shape
    masks = visible if visible is not None else [None] * batch
    native_groups: dict[int, list[int]] = {}
    if native_decode_takes(ops, q.dtype, dim):
        for b, (k, v) in enumerate(zip(keys, values)):
            if masks[b] is None and _native_fits(q, k, v):
                native_groups.setdefault(k.shape[0], []).append(b)
    if len(native_groups) == 1 and len(next(iter(native_groups.values()))) == batch:
        flat = q.reshape(batch, heads, dim).contiguous()
        return ops.decode_attention(flat, keys, values, dim**-0.5).view(q.shape)
    out = torch.empty_like(q)
    on_native = set()
    for members in native_groups.values():
        flat = q[members].reshape(len(members), heads, dim).contiguous()
        group_keys, group_values = [keys[b] for b in members], [values[b] for b in members]
        found = ops.decode_attention(flat, group_keys, group_values, dim**-0.5)
        out[members] = found.view(len(members), heads, 1, dim)
        on_native.update(members)
    for b in range(batch):
        if masks[b] is not None:
            out[b] = matmul_decode_attention(q[b], keys[b], values[b], visible=masks[b])
        elif b not in on_native:
            out[b] = decode_attention(q[b], keys[b], values[b])
    return out


def _native_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the native kernel takes this sequence's cache: values laid out as its keys,
    rows contiguous, of the queries' dtype."""
    return (
        k.stride(-1) == 1 and k.dtype == q.dtype
        and v.shape == k.shape and v.stride() == k.stride() and v.dtype == q.dtype
    )  # fmt: skip


def native_decode_takes(ops, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `ops` has the native decode kernel (it was built and chosen here) and it takes
    queries of this dtype and head size: 2 to 16 vectors of this CPU's lanes."""
    if ops is None or not hasattr(ops, "decode_attention"):
        return False
    lanes = _lanes(ops)
    return (
        head_dim % lanes == 0
        and head_dim // lanes in (2, 4, 8, 16)
        and dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


@functools.cache
def _lanes(ops) -> int:
    """Float lanes of the native decode kernel's vectors (16 AVX512, 8 AVX2, 4 NEON)."""
    return int(ops.decode_attention_lanes())


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query token over every cached entry (all earlier, so no mask).

    q: [Hq, 1, D]; k, v: [Hkv, n, D]. Returns [Hq, 1, D]. On a CPU long caches go through
    matrix products and short ones through the fused kernel; a GPU has its own choice.
    """
    if k.device.type != "cpu":
        return gpu_decode_attention(q, k, v)
    if k.shape[1] >= MATMUL_FROM:
        return matmul_decode_attention(q, k, v)
    return fused_decode_attention(q, k, v)


def gpu_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`decode_attention` on a GPU. On an H100 (benchmarks/gpu.py, docs/gpu.md), one decode
    query over a 128K-token bfloat16 cache of Llama-3.1-8B's shape took 199 us with flash
    attention forced (2.7 TB/s of keys and values), 340 us as two batched matrix products
    and 1479 us with torch's own choice of backend (cuDNN's). Flash attention takes half
    precision only, and only on GPUs it was built for: anything else goes through the matrix
    products."""
    if q.dtype in (torch.float16, torch.bfloat16) and _flash_runs(q.device, q.dtype, q.shape[-1]):
        return fused_decode_attention(q, k, v, SDPBackend.FLASH_ATTENTION)
    return matmul_decode_attention(q, k, v)


@functools.cache
def _flash_runs(device: torch.device, dtype: torch.dtype, dim: int) -> bool:
    """Whether torch's flash attention takes a decode query of this head size here."""
    q = torch.zeros((1, 2, 4, dim), dtype=dtype, device=device)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, q, q)
    except RuntimeError:
        return False
    return True


# Cache length from which decode attention on a CPU runs as matrix products. torch's CPU
# attention kernel parallelises over heads, which leaves cores idle with SmolLM2's 3 KV heads.
# Alone on 30 layers' caches (speedkv measure decode-attention), matrix products per KV head
# were 1.3x faster at 4K tokens and 1.4-2x at 8K, as fast at 2K and slower at 1K; in the
# engine's decode step (speedkv measure decode-breakdown) attention at 8128 tokens fell 1.1x.
MATMUL_FROM = 2048


def _packed(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The query heads that share a KV head as the rows of one query block [Hkv, G, D]: the
    CPU kernels run such a block several times faster than a grouped-query call with a
    single row."""
    heads, _, dim = q.shape
    return q.reshape(kv_heads, heads // kv_heads, dim)


def fused_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: SDPBackend | None = None
) -> torch.Tensor:
    """`decode_attention` through torch's fused kernel: `backend`, or the one torch picks."""
    packed = _packed(q, k.shape[0])
    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
        return F.scaled_dot_product_attention(packed[None], k[None], v[None]).reshape(q.shape)


def matmul_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    per_head: bool | None = None,
    live: torch.Tensor | None = None,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decode_attention` as matrix products, one for the scores and one for the output, the
    softmax in float32 between them (HF's eager rounding: scores and weights in the cache's
    dtype).

    On a CPU (`per_head` by default) one product per KV head, because the cache is a view into
    a buffer with room left, which a batched CPU product would first copy whole. On a GPU one
    batched product over all KV heads reads the view in place (the GPU's path for float32,
    `gpu_decode_attention`).

    `live` ([1], on the device): only the first `live` entries of k, v count, the rest get
    weight exactly 0 (so they must hold finite values). A recorded decode step
    (`graph_decode`) passes a layer's whole buffer this way, so that its shapes and addresses
    stay the same from step to step.

    `visible` (bool [Hkv, n], on the device): only the entries it marks count, the same way
    (a sliding window applied by position, to any cache layout).
    """
    packed = _packed(q, k.shape[0])
    kv_heads, group, dim = packed.shape
    per_head = k.device.type == "cpu" and live is None if per_head is None else per_head
    if per_head:
        scores = torch.empty((kv_heads, group, k.shape[1]), dtype=k.dtype, device=k.device)
        for head in range(kv_heads):
            torch.mm(packed[head], k[head].t(), out=scores[head])
    else:
        scores = torch.bmm(packed, k.transpose(1, 2))
    scores = scores.float().mul_(dim**-0.5)
    if live is not None:
        scores.masked_fill_(torch.arange(k.shape[1], device=k.device) >= live, float("-inf"))
    if visible is not None:
        scores.masked_fill_(~visible[:, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    if not per_head:
        return torch.bmm(weights, v).reshape(q.shape)
    out = torch.empty_like(packed)
    for head in range(kv_heads):
        torch.mm(weights[head], v[head], out=out[head])
    return out.reshape(q.shape)


# torch's variable-length flash attention (CUDA only); a name of its own so that tests on a
# CPU can stand in for it
def _varlen_flash(*args, **kwargs):
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


def flash_takes(cache: torch.Tensor) -> bool:
    """Whether `live_flash_decode_attention` may run over this cache buffer: on a GPU, in
    half precision (flash attention's dtypes)."""
    return cache.device.type == "cuda" and cache.dtype in (torch.float16, torch.bfloat16)


def live_flash_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    live: torch.Tensor,
    starts: tuple[torch.Tensor, torch.Tensor],
    width: int,
) -> torch.Tensor:
    """Masked decode attention through flash attention, for a whole batch in one call: one
    query per sequence and head, q [B, heads, D], over cache buffers laid side by side in
    k, v [kv_heads, B * width, D] (sequence b owns slots [b * width, (b + 1) * width)), of
    which the first `live[b]` ([B] int32, on the device) count. torch's variable-length entry
    point reads the lengths on the device, so a recorded decode step can replay it while the
    caches grow. `starts`, made once before recording: the int32 offsets [0, 1, ..., B] of
    the queries and [0, width, ..., B * width] of the buffers. Returns [B, heads, D].

    On an H200, over one layer's 128K-token buffer of Llama-3.1-8B's shape, one sequence took
    204 us against 324 us for the masked matrix products, and agreed with the per-head
    reference to 9.2e-5 (benchmarks/gpu/h200/3-engine/attention.json). graph_decode checks it
    against the matrix products on the batch's own cache before it records with it."""
    query_starts, key_starts = starts
    return _varlen_flash(
        q, k.transpose(0, 1), v.transpose(0, 1), query_starts, key_starts,
        1, width, 0.0, False, False, seqused_k=live,
    )[0]  # fmt: skip
