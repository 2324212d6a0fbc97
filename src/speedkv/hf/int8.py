"""Weight-only int8: every linear layer of the decoder and the LM head keeps its weight as int8
with one scale per output row (symmetric, absmax / 127); activations stay in the model's dtype.

A batch-1 decode step only reads weights, so halving their bytes is what speeds it up: on this
project's 2-core CPU, torch's `_weight_int8pack_mm` runs SmolLM2's 211 matrix-vector products
about 2.6x faster than bfloat16 ones. The same kernel is slower than a bfloat16 GEMM once more
than a few rows go in (equal at 8, 3x slower at 256), so larger inputs (prefill chunks, wide
batches) dequantize the layer's weight and run an ordinary matmul: the same numbers, the
fast kernel for each shape. Off the CPU the dequantized path is always taken.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from speedkv.errors import UserError

WEIGHTS = ("native", "int8")  # how a loaded model may keep its linear weights
# Rows up to which the int8 kernel beats dequantize + matmul (measured here: equal at 8).
KERNEL_MAX_ROWS = 4


class Int8Linear(nn.Module):
    """A linear layer whose weight is int8 rows times a per-row scale."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        scale = weight.float().abs().amax(dim=1).clamp_min(1e-12) / 127
        rows = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
        # parameters (frozen) rather than buffers, so weight counts and fingerprints see them
        self.qweight = nn.Parameter(rows.contiguous(), requires_grad=False)
        self.scale = nn.Parameter(scale.to(weight.dtype), requires_grad=False)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.qweight, self.scale, dtype)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What `int8_linear` takes: (rows, scale, bias)."""
        return self.qweight, self.scale, self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.qweight, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


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


def quantize_model(model: nn.Module) -> nn.Module:
    """A copy of `model` whose linear layers (decoder layers and LM head) hold int8 weights
    (`model` is left as it was). The embedding and the norms stay as they were; a head tied to
    the embedding gets an int8 copy of its own. `hf.loading.quantize_int8` does this to a
    loaded model."""
    model = copy.deepcopy(model)
    swaps = [
        (parent, child_name, child)
        for parent in model.modules()
        for child_name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    if not swaps:
        raise UserError("this model has no linear layers to quantize")
    for parent, child_name, child in swaps:
        setattr(parent, child_name, Int8Linear(child))
    return model.eval().requires_grad_(False)


def check_weights(weights: str) -> str:
    if weights not in WEIGHTS:
        raise UserError(f"weights must be one of {', '.join(WEIGHTS)}, got '{weights}'")
    return weights
