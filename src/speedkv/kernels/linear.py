"""A linear layer's product on the kernel that suits its weight and rows: speedkv's packed
one-row kernel (kernels/csrc/decode_linear.cpp) or its AMX tile kernel (tile_linear.cpp) on a
packed copy, oneDNN on its own prepacked layout, the int8 kernel (kernels/int8.py), or
torch's F.linear -- in float32 where bfloat16 products are slow here.

A layer is a tuple of tensors: (weight, bias), or int8 (rows, scale, bias); `prepacked`
makes the copy in a layout for one-row products. What the engine decided about the kernels
(`KernelConfig`) comes in as an argument.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from speedkv.kernels.config import TORCH_KERNELS, KernelConfig, NativeOps
from speedkv.kernels.cpu import onednn_bf16
from speedkv.kernels.int8 import int8_linear

Tensors = tuple[torch.Tensor | None, ...]

# Rows from which a bfloat16 product runs in float32 on a CPU whose oneDNN takes no bfloat16
# (AVX2-only x86): torch's own bfloat16 matrix product there is a plain loop, 7.7x slower than
# float32's on a 4096 x 576 x 1536 product (AMD EPYC Zen 3, one thread). A decode step's few
# rows stay in bfloat16: converting the whole weight would cost more than the product.
UPCAST_FROM = 16
# Rows from which it does so where the engine measured float32 faster on a prefill chunk's
# product (`KernelConfig.float32_products`: an AVX512 CPU whose oneDNN runs bfloat16 without
# AMX, say); decode batches, which would convert the weight for a few rows, stay below it.
MEASURED_UPCAST_FROM = 128


def apply_linear(
    x: torch.Tensor, tensors: Tensors, kernels: KernelConfig = TORCH_KERNELS
) -> torch.Tensor:
    """The linear layer `tensors` describe (see `prepacked`) applied to x, on the kernels
    `kernels` chose."""
    weight, *rest = tensors
    if weight.dim() == 4 and _on_tiles(x, weight, len(rest), kernels):  # many rows, AMX
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
    if _bf16_product_is_slow_here(x, weight, kernels):
        return linear_in_float32(x, weight, bias)
    return F.linear(x, weight, bias)


def _on_tiles(x: torch.Tensor, packed: torch.Tensor, extras: int, kernels: KernelConfig) -> bool:
    return kernels.tiles_for_rows(x.numel() // max(1, x.shape[-1])) and tiles_take(
        (packed, *[None] * extras)
    )


def tiles_take(tensors: Tensors) -> bool:
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


def _bf16_product_is_slow_here(
    x: torch.Tensor, weight: torch.Tensor, kernels: KernelConfig
) -> bool:
    if weight.dtype != torch.bfloat16 or not weight.is_cpu:
        return False
    rows = x.numel() // max(1, x.shape[-1])
    if not onednn_bf16():
        return rows >= UPCAST_FROM
    return kernels.float32_products and rows >= MEASURED_UPCAST_FROM


def linear_in_float32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """x @ weight.T (+ bias) as a bfloat16 product computes it, float32 sums rounded once,
    through float32's faster kernels."""
    wide_bias = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), wide_bias).to(x.dtype)


def can_prepack(tensors: Tensors | None, ops: NativeOps = None) -> bool:
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


def prepacked(tensors: Tensors, ops: NativeOps = None) -> Tensors:
    """A copy of a linear layer's tensors with the weight in a layout made for one-row
    inputs. With `ops` (speedkv's native CPU operations) and a bfloat16 or int8 weight its
    kernel takes, speedkv's own layout (kernels/csrc/decode_linear.cpp): one load feeds the
    CPU's bfloat16 dot-product instruction for 16 outputs. Otherwise, for a plain float weight
    (`can_prepack` without ops), oneDNN's blocked layout, which one-row products read faster
    than torch's kernels read the plain weight, with the same results (benchmarks/README.md
    has the rates). The copy is the cost: the layer's weight is held twice."""
    weight, *rest = tensors
    if _native_packable(tensors, ops):
        # scale and bias in float32 once, as the kernel reads them (exact: they were bf16)
        extras = (None if t is None else t.detach().float() for t in rest)
        return ops.pack_linear_weight(weight.detach()), *extras
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1), *rest


def _native_packable(tensors: Tensors, ops: NativeOps) -> bool:
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
