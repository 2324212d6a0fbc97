"""SnapKV (Li et al.): keep, per head, the entries the prompt's last window attends to most.

In every layer after prefill: the last `window` queries attend to all keys; per entry the
scores are summed over those queries and pooled along tokens (`kernel`, `pool`); each head
keeps its top `C - window` earlier entries plus the window, `C = retain * n` (a fraction, or
a whole token count). Prefill compute is unchanged; only the cache shrinks.

`gqa=false` is the reference: selection per query head, after expanding grouped K/V, so the
cache holds one copy per query head. `gqa=true` sums the scores over each KV head's query
heads and keeps one set per KV head: the memory-honest variant for grouped-query models.
Defaults are the authors' (window 32, kernel 5, average pooling); `retain` defaults to 0.1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UserError
from ..policy import LayerView, Policy, PromptInfo, register
from ..scoring import budget, check_budget, group_heads, top_plus_window, window_scores


@register
class SnapKV(Policy):
    name = "snapkv"

    @dataclass
    class Config:
        retain: float = 0.1
        window: int = 32
        kernel: int = 5
        pool: str = "avg"
        gqa: bool = False

    def __init__(self, config: Config, shape):
        super().__init__(config, shape)
        check_budget(config.retain, "retain")
        if config.window < 1 or config.kernel < 1:
            raise UserError("window and kernel must be at least 1")
        if config.pool not in ("max", "avg"):
            raise UserError(f"pool must be 'max' or 'avg', got '{config.pool}'")
        self.n = 0

    def begin(self, prompt: PromptInfo) -> None:
        self.n = prompt.n

    def query_window(self, layer: int) -> int:
        return self.config.window

    def kept(self, layer: int, view: LayerView) -> torch.Tensor | None:
        cfg = self.config
        n = view.kv.length
        keep = budget(cfg.retain, n, "retain")
        if keep >= n:
            return None
        q, q_pos = view.queries()
        w = min(cfg.window, n)
        scores = window_scores(
            q, q_pos, view.kv.keys(), view.kv.positions()[0], w, cfg.kernel, cfg.pool
        )
        if cfg.gqa:
            scores = group_heads(scores, self.shape.num_kv_heads)
        return top_plus_window(scores, keep, n)

    def summary(self) -> dict:
        return {"prompt_tokens": self.n, "kept": budget(self.config.retain, self.n, "retain")}
