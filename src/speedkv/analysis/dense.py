"""SPEED in dense form: one pass over a whole sequence, computed by transformers' own layers.

Lower layers (`< lcut`) see every earlier position; upper layers run only on the full-depth
positions (anchors, the deep suffix, and everything after the prompt), gathered with their
original position ids and causal among themselves. This is the reference the incremental
engine is checked against, and the teacher-forcing forward SPEED-aware training uses: it
shares no attention or cache code with the engine.
"""

from __future__ import annotations

import torch

from speedkv.hf.backbone import Backbone


def full_depth_positions(
    total: int, prompt_len: int, anchors: int, deep: int, device=None
) -> torch.Tensor:
    """Bool [total]: anchors, the last `deep` prompt tokens, and every later position."""
    pos = torch.arange(total, device=device)
    return (pos < anchors) | (pos >= prompt_len - deep)


def speed_dense_forward(
    backbone: Backbone,
    ids: torch.Tensor,
    prompt_len: int,
    lcut: int,
    anchors: int = 1,
    deep: int = 1,
    selfonly: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits at every full-depth position of `ids` ([T] or [1, T]) under SPEED.

    Returns (logits [m, vocab] float32, positions [m]); with lcut == L every position is
    full depth and this is the model's ordinary forward.
    """
    ids = ids.reshape(1, -1).to(backbone.device)
    total = ids.shape[1]
    pos = torch.arange(total, device=ids.device)
    h = backbone.embed(ids)
    lower = (pos[None, :] <= pos[:, None])[None, None]
    for layer in range(min(lcut, backbone.shape.num_layers)):
        h = backbone.hf_layer(layer, h, lower, pos)
    if lcut < backbone.shape.num_layers:
        keep = full_depth_positions(total, prompt_len, anchors, deep, ids.device)
        h, pos = h[:, keep], pos[keep]
        mask = pos[None, :] <= pos[:, None]
        if selfonly:
            mask &= (
                (pos[None, :] == pos[:, None]) | (pos[None, :] < anchors) | (pos[:, None] < anchors)
            )
        for layer in range(lcut, backbone.shape.num_layers):
            h = backbone.hf_layer(layer, h, mask[None, None], pos)
    return backbone.logits(backbone.final_norm(h))[0], pos
