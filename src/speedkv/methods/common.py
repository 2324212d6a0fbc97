"""Pieces several methods share: layer options scaled by depth, window-scoring options, and
the "only the last prompt token continues past a cut" rule of POP and SwiftKV."""

from __future__ import annotations

import torch

from speedkv.core.policy import LayerView, Policy, PromptInfo, Stream
from speedkv.errors import UserError
from speedkv.hf.backbone import ModelShape
from speedkv.methods.scoring import (
    budget,
    group_heads,
    scaled_layer,
    top_plus_window,
    window_scores,
)


def resolve_layer(value: int | None, reference: int, shape: ModelShape, name: str) -> int:
    """A layer option: the authors' index for 32 layers scaled to this depth when unset,
    and checked against the model."""
    layer = scaled_layer(reference, shape.num_layers) if value is None else value
    if not 0 <= layer < shape.num_layers:
        raise UserError(f"{name} must be between 0 and {shape.num_layers - 1}, got {layer}")
    return layer


def check_window_options(window: int, kernel: int, pool: str) -> None:
    if window < 1 or kernel < 1:
        raise UserError("window and kernel must be at least 1")
    if pool not in ("max", "avg"):
        raise UserError(f"pool must be 'max' or 'avg', got '{pool}'")


def window_budget(value: float, n: int, window: int, what: str) -> int:
    """Entries a window-scored selection keeps out of n: the budget, but never fewer than the
    observation window itself, which SnapKV and FastKV always keep (so a prompt shorter than
    the window is kept whole rather than emptied)."""
    return max(budget(value, n, what), min(window, n))


def layer_window_scores(view: LayerView, window: int, kernel: int, pool: str) -> torch.Tensor:
    """Window scores of a finished layer's entries before its observation window: [Hq, n - w]."""
    q, q_pos = view.queries()
    w = min(window, view.kv.length)
    return window_scores(q, q_pos, view.kv.keys(), view.kv.positions()[0], w, kernel, pool)


def keep_per_head(scores: torch.Tensor, keep: int, n: int, kv_heads: int | None) -> torch.Tensor:
    """Indices each head keeps: its best `keep - w` scored entries plus the window; scores of
    query heads are summed per KV head first when `kv_heads` is given."""
    if kv_heads is not None:
        scores = group_heads(scores, kv_heads)
    return top_plus_window(scores, keep, n)


class LastTokenContinues(Policy):
    """Prompt tokens stop at `cut_layer()`; only the last one runs the layers above it."""

    last = -1

    def cut_layer(self) -> int:
        raise NotImplementedError

    def begin(self, prompt: PromptInfo) -> None:
        self.last = int(prompt.positions[-1])

    def computed(self, layer: int, stream: Stream) -> torch.Tensor | None:
        return None if layer < self.cut_layer() else stream.pos == self.last
