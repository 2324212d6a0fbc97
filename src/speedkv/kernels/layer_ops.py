"""torch's own versions of the small operations the native `layer_ops` kernel fuses
(kernels/csrc/layer_ops.cpp), with the same roundings: what runs where it is not used."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)), computed in float32 and rounded to x's dtype before the weight,
    as the Llama-family RMSNorm modules do."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
