"""Linear layers that read the same input, run as one matmul (q, k, v; gate and up).

A decode step is a chain of matrix-vector products; on a CPU each call has a fixed cost on top
of reading its weight, so three projections of one input cost more than one projection with
their rows stacked. `fuse` stacks the weights once and points each original layer's weight at
its slice of the stack, so memory does not grow and the model's own forward (used by the
reference checks and training) computes exactly what it did before.

Only frozen layers of one kind are fused (plain `nn.Linear`, or `Int8Linear`): a layer wrapped
by an adapter under training, or a weight that requires gradients, is run as it is, one call
per layer, with the same result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from speedkv.hf.int8 import Int8Linear, int8_linear

Projection = Callable[[torch.Tensor], torch.Tensor]


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
    if len(tensors) == 3:
        return int8_linear(x, *tensors)
    weight, bias = tensors
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def can_prepack(tensors: tuple[torch.Tensor | None, ...] | None) -> bool:
    """Whether `prepacked` applies: a plain float weight on a CPU with oneDNN."""
    if tensors is None or len(tensors) != 2:
        return False
    weight = tensors[0]
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
    )


def prepacked(tensors: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
    """A copy of a plain linear layer's (weight, bias) with the weight in oneDNN's blocked
    layout for one-row inputs: matrix-vector products read it about 1.8x faster on this
    project's CPU than torch's own kernels read the plain weight (same results). The copy
    is the cost: the layer's weight is held twice."""
    weight, bias = tensors
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1), bias


def _fuse(parts: list[nn.Module]) -> tuple[Projection, tuple | None]:
    frozen = all(not p.requires_grad for m in parts for p in m.parameters())
    with_bias = {getattr(m, "bias", None) is not None for m in parts}
    if frozen and len(with_bias) == 1 and all(type(m) is nn.Linear for m in parts):
        weight = _stack(parts, "weight")
        bias = _stack(parts, "bias") if with_bias == {True} else None
        return (lambda x: F.linear(x, weight, bias)), (weight, bias)
    if frozen and len(with_bias) == 1 and all(type(m) is Int8Linear for m in parts):
        fused = Int8Linear.from_rows(
            _stack(parts, "qweight"),
            _stack(parts, "scale"),
            _stack(parts, "bias") if with_bias == {True} else None,
        )
        return fused, fused.tensors()
    return (lambda x: torch.cat([m(x) for m in parts], dim=-1)), None


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
