"""Weight-only int8: every linear layer of the decoder and the LM head keeps its weight as int8
with one scale per output row (symmetric, absmax / 127); activations stay in the model's dtype.
The products run in kernels/int8.py: torch's int8 kernel for a decode step's few rows on a CPU,
an ordinary matmul with the dequantized weight for larger inputs and off the CPU.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from speedkv.errors import UserError
from speedkv.kernels.int8 import dequantize, int8_linear

WEIGHTS = ("native", "int8")  # how a loaded model may keep its linear weights


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
