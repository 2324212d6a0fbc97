"""Linear layers that read the same input, run as one matmul (q, k, v; gate and up).

A decode step is a chain of matrix-vector products; on a CPU each call has a fixed cost on top
of reading its weight, so three projections of one input cost more than one projection with
their rows stacked. `FusedProjection` stacks the weights once and points each original layer's
weight at its slice of the stack, so memory does not grow and the model's own forward (used by
the reference checks and training) computes exactly what it did before.

Only frozen layers of one kind are fused (plain `nn.Linear`, or `Int8Linear`): a layer wrapped
by an adapter under training, or a weight that requires gradients, is run as it is, one call
per layer, with the same result.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from speedkv.hf.int8 import Int8Linear, int8_linear

Projection = Callable[[torch.Tensor], torch.Tensor]
# torch.ops.speedkv: speedkv's native CPU operations (core/native.py), which the engine hands
# to the backbone; this package only calls them and never builds them
NativeOps = Any


class FusedProjection:
    """Several linear layers over one input; returns their outputs concatenated on the last
    dimension, in order. `sizes` are the output widths of the parts."""

    def __init__(self, parts: Sequence[nn.Module]):
        self.parts = list(parts)
        self.sizes = [p.out_features for p in self.parts]
        self.run: Projection
        # the fused weights as `apply_linear` takes them; None when the parts run one by one
        self.tensors: tuple[torch.Tensor | None, ...] | None
        self.run, self.tensors = _fuse(self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)


def linear_tensors(module: nn.Module) -> tuple[torch.Tensor | None, ...] | None:
    """A frozen plain or int8 linear layer's tensors as `apply_linear` takes them: (weight,
    bias) or (rows, scale, bias); None for anything else (an adapter wrapper, a trainable
    layer)."""
    if any(p.requires_grad for p in module.parameters()):
        return None
    if type(module) is nn.Linear:
        return module.weight, module.bias
    if type(module) is Int8Linear:
        return module.tensors()
    return None


def apply_linear(x: torch.Tensor, tensors: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    """The linear layer `tensors` describe (see `linear_tensors`, `prepacked`) applied to x."""
    weight, *rest = tensors
    if weight.dim() == 4 and _on_tiles(x, weight, len(rest)):  # many rows, AMX
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return torch.ops.speedkv.tile_linear(rows, weight, rest[-1]).view(*x.shape[:-1], -1)
    if weight.dim() == 4:  # packed by speedkv's native kernel (see `prepacked`)
        scale = rest[0] if len(rest) == 2 else None
        return torch.ops.speedkv.packed_linear(x.contiguous(), weight, scale, rest[-1])
    if len(tensors) == 3:
        return int8_linear(x, *tensors)
    bias = rest[0]
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if _bf16_product_is_slow_here(x, weight):
        return linear_in_float32(x, weight, bias)
    return F.linear(x, weight, bias)


# Rows from which a bfloat16 product runs in float32 on a CPU whose oneDNN takes no bfloat16
# (AVX2-only x86): torch's own bfloat16 matrix product there is a plain loop, 7.7x slower than
# float32's on a 4096 x 576 x 1536 product (AMD EPYC Zen 3, one thread). A decode step's few
# rows stay in bfloat16: converting the whole weight would cost more than the product.
UPCAST_FROM = 16
# Rows from which it does so where the engine measured float32 faster on a prefill chunk's
# product (`prefer_float32_products`: an AVX512 CPU whose oneDNN runs bfloat16 without AMX,
# say); decode batches, which would convert the weight for a few rows, stay below it.
MEASURED_UPCAST_FROM = 128
_float32_products = False  # set by `prefer_float32_products`


# Rows above which a product on speedkv's packed bfloat16 copy runs on the AMX tile kernel
# (core/csrc/tile_linear.cpp) rather than the one-row kernel; None: never (set by the engine
# from the kernel choice measured on this machine).
_tiles_above: int | None = None


def use_tiles_above(rows: int | None) -> None:
    """Products on the packed copy with more than `rows` rows go to the AMX tile kernel."""
    global _tiles_above
    _tiles_above = rows


def tiles_for_rows(rows: int) -> bool:
    """Whether products of `rows` rows on a packed copy the tile kernel takes go to it."""
    return _tiles_above is not None and rows > _tiles_above


def _on_tiles(x: torch.Tensor, packed: torch.Tensor, extras: int) -> bool:
    return tiles_for_rows(x.numel() // max(1, x.shape[-1])) and tiles_take(
        (packed, *[None] * extras)
    )


def tiles_take(tensors: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether the tile kernel takes a packed layer (see `prepacked`): a bfloat16 weight (not
    int8 rows, which come with a scale), inputs and outputs in whole tiles of 32."""
    weight = tensors[0]
    return (
        weight.dim() == 4
        and weight.dtype == torch.bfloat16
        and len(tensors) == 2
        and weight.shape[0] % 2 == 0
        and (2 * weight.shape[1]) % 32 == 0
    )


def prefer_float32_products(enabled: bool) -> None:
    """Run bfloat16 CPU products of MEASURED_UPCAST_FROM rows or more in float32, rounded once
    (the engine sets it from the kernel choice measured on this machine)."""
    global _float32_products
    _float32_products = enabled


def _bf16_product_is_slow_here(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if weight.dtype != torch.bfloat16 or not weight.is_cpu:
        return False
    rows = x.numel() // max(1, x.shape[-1])
    if not onednn_bf16():
        return rows >= UPCAST_FROM
    return _float32_products and rows >= MEASURED_UPCAST_FROM


def linear_in_float32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """x @ weight.T (+ bias) as a bfloat16 product computes it, float32 sums rounded once,
    through float32's faster kernels."""
    wide_bias = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), wide_bias).to(x.dtype)


def can_prepack(tensors: tuple[torch.Tensor | None, ...] | None, ops: NativeOps = None) -> bool:
    """Whether `prepacked` applies: a plain float weight on a CPU whose oneDNN takes its dtype,
    or one that speedkv's native kernel takes (bfloat16, or int8 rows of a bfloat16 model)."""
    if tensors is None:
        return False
    if _native_packable(tensors, ops):
        return True
    weight = tensors[0]
    return (
        len(tensors) == 2
        and weight.device.type == "cpu"
        and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and onednn_bf16()))
        and torch.backends.mkldnn.is_available()
    )


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN takes bfloat16 weights here: it needs AVX512BW/VL/DQ or AVX-NE-CONVERT,
    and raises on a CPU without them (AVX2-only x86) where torch's own kernels still work."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepacked(
    tensors: tuple[torch.Tensor | None, ...], ops: NativeOps = None
) -> tuple[torch.Tensor | None, ...]:
    """A copy of a linear layer's tensors (see `linear_tensors`) with the weight in a layout
    made for one-row inputs. With `ops` (speedkv's native CPU operations) and a bfloat16 or
    int8 weight its kernel takes, speedkv's own layout (core/csrc/decode_linear.cpp): one
    load feeds the CPU's bfloat16 dot-product instruction for 16 outputs. Otherwise, for a
    plain float weight (`can_prepack` without ops), oneDNN's blocked layout, which one-row
    products read faster than torch's kernels read the plain weight, with the same results
    (benchmarks/README.md has the rates). The copy is the cost: the layer's weight is held
    twice."""
    weight, *rest = tensors
    if _native_packable(tensors, ops):
        # scale and bias in float32 once, as the kernel reads them (exact: they were bf16)
        extras = (None if t is None else t.detach().float() for t in rest)
        return ops.pack_linear_weight(weight.detach()), *extras
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1), *rest


def _native_packable(tensors: tuple[torch.Tensor | None, ...], ops: NativeOps) -> bool:
    """bfloat16 weights, or int8 rows whose scale is bfloat16 (so inputs are), of a shape the
    kernel tiles: outputs a multiple of 16, inputs even."""
    weight = tensors[0]
    model_dtype = weight.dtype if len(tensors) == 2 else tensors[1].dtype
    return (
        ops is not None
        and hasattr(ops, "pack_linear_weight")  # built for CPUs with AVX512-BF16 or AVX2
        and weight.device.type == "cpu"
        and weight.dtype == (torch.bfloat16 if len(tensors) == 2 else torch.int8)
        and model_dtype == torch.bfloat16
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 2 == 0
    )


def _fuse(parts: list[nn.Module]) -> tuple[Projection, tuple | None]:
    tensors = [linear_tensors(m) for m in parts]
    # one kind of layer (plain or int8), all with a bias or none: stack; else one by one
    kinds = {None if t is None else (len(t), t[-1] is None) for t in tensors}
    if None in kinds or len(kinds) != 1:
        return (lambda x: torch.cat([m(x) for m in parts], dim=-1)), None
    names = ["weight"] if len(tensors[0]) == 2 else ["qweight", "scale"]
    bias = None if tensors[0][-1] is None else _stack(parts, "bias")
    fused = (*(_stack(parts, name) for name in names), bias)
    return (lambda x: apply_linear(x, fused)), fused


def _stack(parts: list[nn.Module], name: str) -> torch.Tensor:
    """The parts' `name` tensors stacked along rows; each part's parameter is replaced by a
    view of its rows, so the stack is the only copy."""
    tensors = [getattr(m, name) for m in parts]
    stacked = torch.cat([t.detach() for t in tensors])
    start = 0
    for module, tensor in zip(parts, tensors):
        rows = tensor.shape[0]
        setattr(module, name, nn.Parameter(stacked[start : start + rows], requires_grad=False))
        start += rows
    return stacked
