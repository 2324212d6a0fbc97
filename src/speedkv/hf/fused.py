"""Linear layers that read the same input, run as one matmul (q, k, v; gate and up).

A decode step is a chain of matrix-vector products; on a CPU each call has a fixed cost on top
of reading its weight, so three projections of one input cost more than one projection with
their rows stacked. `FusedProjection` stacks the weights once and points each original layer's
weight at its slice of the stack, so memory does not grow and the model's own forward (used by
the reference checks and training) computes exactly what it did before.

Only frozen layers of one kind are fused (plain `nn.Linear`, or `Int8Linear`): a layer wrapped
by an adapter under training, or a weight that requires gradients, is run as it is, one call
per layer, with the same result.

The products themselves run in kernels/linear.py, on the kernels the engine chose
(`KernelConfig`, which the backbone passes in).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from speedkv.hf.int8 import Int8Linear
from speedkv.kernels.config import TORCH_KERNELS, KernelConfig
from speedkv.kernels.linear import apply_linear

Projection = Callable[[torch.Tensor, KernelConfig], torch.Tensor]


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

    def __call__(self, x: torch.Tensor, kernels: KernelConfig = TORCH_KERNELS) -> torch.Tensor:
        return self.run(x, kernels)


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


def _fuse(parts: list[nn.Module]) -> tuple[Projection, tuple | None]:
    tensors = [linear_tensors(m) for m in parts]
    # one kind of layer (plain or int8), all with a bias or none: stack; else one by one
    kinds = {None if t is None else (len(t), t[-1] is None) for t in tensors}
    if None in kinds or len(kinds) != 1:
        return (lambda x, _: torch.cat([m(x) for m in parts], dim=-1)), None
    names = ["weight"] if len(tensors[0]) == 2 else ["qweight", "scale"]
    bias = None if tensors[0][-1] is None else _stack(parts, "bias")
    fused = (*(_stack(parts, name) for name in names), bias)
    return (lambda x, kernels: apply_linear(x, fused, kernels)), fused


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
