"""SPEED in dense form: one pass over a whole sequence, computed by transformers' own layers.

Lower layers (`< lcut`) see every earlier position; upper layers run only on the full-depth
positions (anchors, the deep suffix, and everything after the prompt), gathered with their
original position ids and visible to each other as `SpeedRule` says (a sliding-window layer
within its window, by those positions). This is the reference
the incremental engine is checked against, and the teacher-forcing forward SPEED-aware
training uses: it shares no attention or cache code with the engine.
"""

from __future__ import annotations

import torch

from speedkv.hf.backbone import Backbone
from speedkv.methods.speed import SpeedRule


def speed_hidden(
    backbone: Backbone,
    ids: torch.Tensor,
    prompt_len: int,
    rule: SpeedRule,
    header_tokens: int | None = None,
    full_depth: torch.Tensor | None = None,
    turn_tokens: int | None = None,
    taps: dict[int, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Final-normed hidden states [m, H] at every full-depth position of `ids` ([T] or
    [1, T]) under `rule`, and those positions [m]. With lcut == L every position is full
    depth and this is the model's ordinary forward. `header_tokens` and `turn_tokens` size
    the deep suffix of `deep=header` and `deep=turn` (SpeedRule.deep_tokens).

    `taps`, if given, receives each layer's output [1, rows, H] by layer index: a lower
    layer's over every position, an upper layer's over the returned positions.

    `full_depth` (bool [T]) names the full-depth positions outright instead of the rule's
    anchors and deep suffix: a sequence built in several prefills (a cached document, then
    a question; the turns of a chat) has one deep suffix per prefill."""
    h, pos = _lower(backbone, rule, ids, taps)
    h, pos = _upper(
        backbone, rule, h, pos, prompt_len, header_tokens, full_depth, turn_tokens, taps
    )
    return backbone.final_norm(h)[0], pos


def speed_and_full_hidden(
    backbone: Backbone,
    ids: torch.Tensor,
    prompt_len: int,
    rule: SpeedRule,
    header_tokens: int | None = None,
    turn_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`speed_hidden` under `rule`, its positions, and the same model's full-depth hidden
    states [T, H] at every position, in one pass. Below the cutoff SPEED's layers are the
    full model's (plain causal attention over every position, `SpeedRule.visibility`), so
    they run once for both; only the upper layers run twice."""
    h, pos = _lower(backbone, rule, ids)
    full_rule = SpeedRule.full(backbone.shape.num_layers)
    h_full = _layers(backbone, full_rule, range(rule.lcut, backbone.shape.num_layers), h, pos)
    h_speed, pos_speed = _upper(
        backbone, rule, h, pos, prompt_len, header_tokens, None, turn_tokens
    )
    return backbone.final_norm(h_speed)[0], pos_speed, backbone.final_norm(h_full)[0]


def _lower(
    backbone: Backbone,
    rule: SpeedRule,
    ids: torch.Tensor,
    taps: dict[int, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layers below the cutoff over every position of ids: hidden states [1, T, H] and
    positions [T]."""
    ids = ids.reshape(1, -1).to(backbone.device)
    pos = torch.arange(ids.shape[1], device=ids.device)
    lower = range(min(rule.lcut, backbone.shape.num_layers))
    return _layers(backbone, rule, lower, backbone.embed(ids), pos, taps), pos


def _upper(
    backbone: Backbone,
    rule: SpeedRule,
    h: torch.Tensor,
    pos: torch.Tensor,
    prompt_len: int,
    header_tokens: int | None,
    full_depth: torch.Tensor | None,
    turn_tokens: int | None,
    taps: dict[int, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layers from the cutoff up over the full-depth rows of `_lower`'s output."""
    layers = backbone.shape.num_layers
    if rule.lcut >= layers:
        return h, pos
    keep = full_depth.to(pos.device) if full_depth is not None else None
    if keep is None:
        keep = rule.full_depth(pos, prompt_len, rule.deep_tokens(header_tokens, turn_tokens))
    h, pos = h[:, keep], pos[keep]
    return _layers(backbone, rule, range(rule.lcut, layers), h, pos, taps), pos


def _layers(
    backbone: Backbone,
    rule: SpeedRule,
    layers: range,
    h: torch.Tensor,
    pos: torch.Tensor,
    taps: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run `layers` (all on one side of the cutoff) over h. Layers with the same sliding
    window (or none) share one mask."""
    masks: dict[int | None, torch.Tensor] = {}
    for layer in layers:
        window = backbone.shape.window(layer)
        if window not in masks:
            masks[window] = rule.visibility(layer, pos, pos, window)[None, None]
        h = backbone.hf_layer(layer, h, masks[window], pos)
        if taps is not None:
            taps[layer] = h
    return h


def speed_dense_forward(
    backbone: Backbone,
    ids: torch.Tensor,
    prompt_len: int,
    lcut: int,
    anchors: int = 1,
    deep: int = 1,
    selfonly: bool = False,
    stride: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (float32) [m, vocab] at every full-depth position of `ids` under SPEED with
    these options, and those positions [m]: `speed_hidden` followed by the LM head."""
    h, pos = speed_hidden(
        backbone,
        ids,
        prompt_len,
        SpeedRule(lcut, anchors, deep, selfonly, backbone.shape.largest_window, stride),
    )
    return backbone.logits(h), pos
