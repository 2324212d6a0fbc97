"""Weight-only int8 products: torch's int8 kernel for a few input rows on a CPU, else an
ordinary matmul with the dequantized weight (hf/int8.py makes the layers that hold them).

A batch-1 decode step only reads weights, so halving their bytes is what speeds it up: on this
project's 2-core CPU, torch's `_weight_int8pack_mm` runs SmolLM2's 211 matrix-vector products
about 2.6x faster than bfloat16 ones. The same kernel is slower than a bfloat16 GEMM once more
than a few rows go in (equal at 8, 3x slower at 256), so larger inputs (prefill chunks, wide
batches) dequantize the layer's weight and run an ordinary matmul: the same numbers, the
fast kernel for each shape. Off the CPU the dequantized path is always taken.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows up to which the int8 kernel beats dequantize + matmul (measured here: equal at 8).
KERNEL_MAX_ROWS = 4


def int8_linear(
    x: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ (rows * scale).T + bias: the int8 kernel for a few input rows on a CPU, else a
    matmul with the dequantized weight."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= KERNEL_MAX_ROWS and x.device.type == "cpu":
        scale = scale if scale.dtype == x.dtype else scale.to(x.dtype)
        out = torch.ops.aten._weight_int8pack_mm(flat.contiguous(), rows, scale)
        out = out.reshape(*x.shape[:-1], rows.shape[0])
        return out if bias is None else out + bias
    return F.linear(x, dequantize(rows, scale, x.dtype), bias)


def dequantize(rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight int8 `rows` times their per-row `scale` stand for, in `dtype`."""
    return rows.to(dtype) * scale.to(dtype)[:, None]
