"""PyramidInfer (Yang et al.): fewer tokens in each deeper layer, chosen by recent attention.

The last `recent` prompt tokens (a fraction, or a whole count) are never dropped; their
queries, weighted by distance (linearly from 1 for the oldest to `distance_weight` for the
newest) and averaged over queries and heads, score every earlier token ("pivotal context").
Before layer l the context shrinks to `ratio(l)` of what reached layer l-1, with the
authors' cosine schedule `ratio(l) = (1 - decay) * (cos(pi * l / L) + 1) / 2 + decay`,
unless that would leave `min_context` tokens or fewer; the first `sink` positions always stay.
Dropped tokens leave the residual stream (they are not computed deeper), positions are kept,
and each layer's cache holds exactly what reached it. Decode runs over those caches.

Defaults follow the authors' released settings (recent 0.2, decay 0.9, cosine, min context
64, distance weight 1.2, 4 sink tokens). The reference also compresses generated tokens once
they exceed a threshold; this implementation keeps them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from speedkv.core.policy import LayerView, Policy, PromptInfo, Stream
from speedkv.core.registry import register
from speedkv.errors import UserError
from speedkv.methods.retention import keep_mask
from speedkv.methods.scoring import attention_probs, budget, check_budget


@register
class PyramidInfer(Policy):
    name = "pyramidinfer"
    degenerate_specs = ("pyramidinfer:decay=1",)

    @dataclass
    class Config:
        recent: float = 0.2
        decay: float = 0.9
        schedule: str = "cosine"
        min_context: int = 64
        distance_weight: float = 1.2
        sink: int = 4

    def __init__(self, config: Config, shape):
        super().__init__(config, shape)
        check_budget(config.recent, "recent")
        if not 0 < config.decay <= 1:
            raise UserError(f"decay must be in (0, 1], got {config.decay:g}")
        if config.schedule not in ("cosine", "linear"):
            raise UserError(f"schedule must be 'cosine' or 'linear', got '{config.schedule}'")
        if config.min_context < 0 or config.sink < 0:
            raise UserError("min_context and sink must be >= 0")
        self.recent = 0
        self.selected: torch.Tensor | None = None
        self.context_per_layer: list[int] = []

    def ratio(self, layer: int) -> float:
        d, L = self.config.decay, self.shape.num_layers
        if self.config.schedule == "linear":
            return (1 - d) * (1 - layer / L) + d
        return (1 - d) * (math.cos(math.pi * layer / L) + 1) / 2 + d

    def begin(self, prompt: PromptInfo) -> None:
        self.recent = max(1, budget(self.config.recent, prompt.n, "recent"))
        self.selected, self.context_per_layer = None, []

    def query_window(self, layer: int) -> int:
        return self.recent

    def observe(self, layer: int, view: LayerView) -> None:
        self.selected = None
        n = view.kv.length
        context = n - min(self.recent, n)
        self.context_per_layer.append(context)
        nxt = layer + 1
        if nxt >= self.shape.num_layers or context <= self.config.min_context:
            return
        keep = int(context * self.ratio(nxt))
        if keep <= self.config.min_context or keep >= context:
            return
        q, q_pos = view.queries()
        k_pos = view.kv.positions()[0]
        probs = attention_probs(q, q_pos, view.kv.keys(), k_pos)[..., :context]  # [Hq, w, ctx]
        weights = torch.linspace(1.0, self.config.distance_weight, q.shape[1], device=q.device)
        scores = (probs * weights[None, :, None]).mean(1).mean(0)
        scores[k_pos[:context] < self.config.sink] = float("inf")
        self.selected = keep_mask(scores, keep + n - context, n)  # the recent rows stay too

    def computed(self, layer: int, stream: Stream) -> torch.Tensor | None:
        return self.selected if layer > 0 else None

    def summary(self) -> dict:
        return {"recent": self.recent, "context_per_layer": self.context_per_layer}
