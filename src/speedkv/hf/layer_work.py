"""A layer's dense work, as functions of the layer's weights: for a decode step's tokens and
for a prefill chunk's rows.

Everything a token does in a layer besides attention -- norm, q/k/v projection, rotary,
output projection, residual, norm, MLP, residual -- is the same computation in every layer
with other weights. These functions take the weights as plain tensors (fused q/k/v and
gate/up; for decode optionally prepacked for one-row products: see kernels/linear.py), so a
layer runs a few large operations instead of the model's modules, one by one.

A layer runs through here only when every piece is a plain tensor operation: frozen plain or
int8 linear layers, the families' RMSNorm, SiLU, no per-head q/k norms. Otherwise the backbone
runs the model's own modules (see `Backbone.decode_weights`).

Given `kernels` (the engine's kernel configuration, which the backbone passes in) with native
operations, the small
steps -- norm, residual add and norm, rotary and the split into heads, SiLU times up -- are one
call each instead of a dozen, with the same roundings. Where every piece of a decode step's
layer is native, the whole layer, attention and the cache write included, is one call
(`decode_layer`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speedkv.kernels.config import TORCH_KERNELS, KernelConfig, NativeOps
from speedkv.kernels.layer_ops import rms_norm
from speedkv.kernels.linear import apply_linear

Linear = tuple[torch.Tensor | None, ...]  # (weight, bias) or int8 (rows, scale, bias)


@dataclass(frozen=True)
class LayerTensors:
    """One decoder layer's weights."""

    input_norm: torch.Tensor
    qkv: Linear  # q, k, v rows stacked
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # gate, up rows stacked
    down: Linear


@dataclass(frozen=True)
class LayerDims:
    """What the functions need to know besides the weights (the same in every layer)."""

    eps: float
    qkv_sizes: tuple[int, int, int]
    head_dim: int
    intermediate: int


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half layout used by HF Llama-family checkpoints.

    x: [..., heads, n, head_dim]; cos, sin: [n, head_dim] (broadcast over heads).
    """
    return x * cos + rotate_half(x) * sin


def heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[..., n, heads*D] -> [..., heads, n, D]."""
    return x.unflatten(-1, (-1, head_dim)).transpose(-3, -2)


def native_rows(h: torch.Tensor, norm: torch.Tensor, ops: NativeOps) -> bool:
    """Whether the native small operations take h: they were built here, one token per
    sequence ([B, 1, H], a decode step) or one sequence's rows ([n, H], a prefill chunk), in
    CPU memory as rows, with a norm weight of h's dtype. Anything else runs torch's."""
    one_token_each = h.dim() == 3 and h.shape[1] == 1
    return (
        ops is not None
        and hasattr(ops, "rms_norm")
        and (one_token_each or h.dim() == 2)
        and h.device.type == "cpu"
        and h.is_contiguous()
        and norm.dtype == h.dtype
    )


def before_attention(
    h: torch.Tensor,
    weights: LayerTensors,
    cos: torch.Tensor,
    sin: torch.Tensor,
    dims: LayerDims,
    kernels: KernelConfig = TORCH_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Post-rotary q [..., Hq, n, D] and k, v [..., Hkv, n, D] of the residual h [..., n, H]."""
    ops = kernels.ops
    if native_rows(h, weights.input_norm, ops):
        qkv = apply_linear(ops.rms_norm(h, weights.input_norm, dims.eps), weights.qkv, kernels)
        q_heads, kv_heads = (size // dims.head_dim for size in dims.qkv_sizes[:2])
        rows = qkv.view(-1, 1, qkv.shape[-1])  # one token a row, decode or prefill
        q, k, v = ops.rotary_split(rows, cos, sin, q_heads, kv_heads)  # [rows, heads, 1, D]
        if h.dim() == 2:  # a prefill chunk: [heads, n, D], as views
            q, k, v = (t.squeeze(2).transpose(0, 1) for t in (q, k, v))
        return q, k, v
    x = rms_norm(h, weights.input_norm, dims.eps)
    q, k, v = apply_linear(x, weights.qkv, kernels).split(dims.qkv_sizes, dim=-1)
    q, k, v = heads(q, dims.head_dim), heads(k, dims.head_dim), heads(v, dims.head_dim)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def after_attention(
    h: torch.Tensor,
    o: torch.Tensor,
    weights: LayerTensors,
    dims: LayerDims,
    kernels: KernelConfig = TORCH_KERNELS,
) -> torch.Tensor:
    """The residual leaving the layer, from the one entering it (h [..., n, H]) and the
    attention output o [..., Hq, n, D]."""
    ops = kernels.ops
    if native_rows(h, weights.post_norm, ops):
        attended = apply_linear(o.transpose(-3, -2).flatten(-2), weights.o, kernels)
        h, x = ops.add_rms_norm(h, attended, weights.post_norm, dims.eps)
        up = ops.silu_mul(apply_linear(x, weights.gate_up, kernels))
        return h + apply_linear(up, weights.down, kernels)
    h = h + apply_linear(o.transpose(-3, -2).flatten(-2), weights.o, kernels)
    x = rms_norm(h, weights.post_norm, dims.eps)
    gate, up = apply_linear(x, weights.gate_up, kernels).split(dims.intermediate, dim=-1)
    return h + apply_linear(F.silu(gate) * up, weights.down, kernels)


def native_layer_args(
    weights: LayerTensors,
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """A layer's weights packed for decode as `decode_layer` takes them: the input norm, q/k/v,
    output, post norm, gate/up and down weights; then each product's scale (int8 weights) and
    bias."""
    products = (weights.qkv, weights.o, weights.gate_up, weights.down)
    qkv, o, gate_up, down = (p[0] for p in products)
    tensors = [weights.input_norm, qkv, o, weights.post_norm, gate_up, down]
    extras = [t for p in products for t in (p[1] if len(p) == 3 else None, p[-1])]
    return tensors, extras  # type: ignore[return-value]


def decode_layer(
    h: torch.Tensor,
    args: tuple[list[torch.Tensor], list[torch.Tensor | None]],
    cos: torch.Tensor,
    sin: torch.Tensor,
    dims: LayerDims,
    ops: NativeOps,
    caches: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[int]],
    token_positions: list[int],
    tiles: bool,
) -> torch.Tensor:
    """A decode step's whole layer in one native call (kernels/csrc/decode_layer.cpp): what
    `before_attention`, writing each sequence's new key and value, the native decode
    attention and `after_attention` compute, bit for bit. h: [B, 1, H]; `args` from
    `native_layer_args`; `caches`: each sequence's key, value and position buffers of this
    layer and its live length (the token goes into that slot, which must exist); `tiles`:
    the products run on the AMX tile kernel."""
    weights, extras = args
    keys, values, positions, lengths = caches
    q_heads, kv_heads = (size // dims.head_dim for size in dims.qkv_sizes[:2])
    return ops.decode_layer(
        h, cos, sin, weights, extras, keys, values, positions, lengths, token_positions,
        dims.eps, q_heads, kv_heads, tiles,
    )  # fmt: skip
