"""Pieces several methods share: layer options scaled by depth, and the "only the last prompt
token continues past a cut" rule of POP and SwiftKV. (Score-then-keep retention and its
window scoring are in `retention`.)"""

from __future__ import annotations

import torch

from speedkv.core.policy import Policy, PromptInfo, Stream
from speedkv.errors import UserError
from speedkv.hf.backbone import ModelShape
from speedkv.methods.scoring import scaled_layer


def resolve_layer(value: int | None, reference: int, shape: ModelShape, name: str) -> int:
    """A layer option: the authors' index for 32 layers scaled to this depth when unset,
    and checked against the model."""
    layer = scaled_layer(reference, shape.num_layers) if value is None else value
    if not 0 <= layer < shape.num_layers:
        raise UserError(f"{name} must be between 0 and {shape.num_layers - 1}, got {layer}")
    return layer


class LastTokenContinues(Policy):
    """Prompt tokens stop at `cut_layer()`; only the last one runs the layers above it."""

    last = -1

    def cut_layer(self) -> int:
        raise NotImplementedError

    def begin(self, prompt: PromptInfo) -> None:
        self.last = int(prompt.positions[-1])

    def computed(self, layer: int, stream: Stream) -> torch.Tensor | None:
        return None if layer < self.cut_layer() else stream.pos == self.last
