"""SPEED -- Shallow Prefill, dEEp Decode (Oh et al., 2026).

Prompt tokens are computed and cached only in layers `< lcut`; decode-phase tokens run through
every layer. Three kinds of prompt position:

- anchors (`anchors=bos`: position 0; `sink:K`: positions 0..K-1; `none`): full depth,
- the deep suffix (the last `deep` prompt tokens, or the chat template's generation header
  with `deep=header`): treated as decode-phase tokens, so the first new token's logits come
  from a full-depth state,
- shallow tokens: every other prompt position, never computed in layers `>= lcut`.

In upper layers a query therefore sees earlier anchors and earlier deep/generated tokens only,
because that is all those layers ever hold. `selfonly=true` is the paper's SelfOnly ablation:
upper-layer decode-phase tokens see only themselves (and the anchors), so their upper-layer K/V
is never cached. Position ids are never renumbered.

`lcut` defaults to round(0.75 * L), the paper's operating point (24 of 32 layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speedkv.core.policy import LayerView, Policy, PromptInfo, Stream
from speedkv.core.registry import register
from speedkv.errors import UserError


@register
class Speed(Policy):
    name = "speed"

    @dataclass
    class Config:
        lcut: int | None = None
        anchors: str = "bos"
        deep: int | str = 1
        selfonly: bool = False

    def __init__(self, config: Config, shape):
        super().__init__(config, shape)
        layers = shape.num_layers
        if config.lcut is None:
            config.lcut = round(0.75 * layers)
        if not 0 <= config.lcut <= layers:
            raise UserError(
                f"lcut must be between 0 and {layers} for this model, got {config.lcut}"
            )
        self.num_anchors = parse_anchors(config.anchors)
        if isinstance(config.deep, int) and config.deep < 1:
            raise UserError(f"deep must be a token count >= 1 or 'header', got {config.deep}")
        if isinstance(config.deep, str) and config.deep != "header":
            raise UserError(f"deep must be a token count >= 1 or 'header', got '{config.deep}'")
        self.deep_start = 0

    @property
    def lcut(self) -> int:
        return self.config.lcut

    def deep_tokens(self, prompt: PromptInfo) -> int:
        """D for this prompt: the option, or the generation header's length (1 for raw text)."""
        if self.config.deep == "header":
            return max(1, prompt.header_tokens or 1)
        return self.config.deep

    def begin(self, prompt: PromptInfo) -> None:
        self.deep_start = max(0, prompt.n - self.deep_tokens(prompt))

    def full_depth(self, pos: torch.Tensor) -> torch.Tensor:
        """Which positions are anchors or deep-suffix tokens (bool, same shape as pos)."""
        return (pos < self.num_anchors) | (pos >= self.deep_start)

    def computed(self, layer: int, stream: Stream) -> torch.Tensor | None:
        if layer < self.lcut:
            return None
        return self.full_depth(stream.pos)

    def visible(self, layer: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        if not self.config.selfonly or layer < self.lcut:
            return None
        # SelfOnly: a deep token sees itself and the anchors; an anchor sees what it would anyway.
        q_anchor = q_pos[:, None] < self.num_anchors
        return q_anchor | (k_pos[None, :] == q_pos[:, None]) | (k_pos[None, :] < self.num_anchors)

    def kept(self, layer: int, view: LayerView) -> torch.Tensor | None:
        if not self.config.selfonly or layer < self.lcut:
            return None
        # nobody will ever read an upper deep token's K/V
        return view.kv.positions()[0] < self.num_anchors

    def keeps_decode_kv(self, layer: int) -> bool:
        return not (self.config.selfonly and layer >= self.lcut)


def parse_anchors(value: str) -> int:
    """'bos' -> 1, 'none' -> 0, 'sink:K' -> K: the number of leading full-depth positions."""
    if value == "bos":
        return 1
    if value == "none":
        return 0
    kind, _, count = value.partition(":")
    if kind == "sink" and count.isdigit() and int(count) >= 1:
        return int(count)
    raise UserError(f"anchors must be 'bos', 'none' or 'sink:K' with K >= 1, got '{value}'")
