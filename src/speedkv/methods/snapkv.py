"""SnapKV (Li et al.): keep, per head, the entries the prompt's last window attends to most.

In every layer after prefill: the last `window` queries attend to all keys; per entry the
scores are summed over those queries and pooled along tokens (`kernel`, `pool`); each head
keeps its top `C - window` earlier entries plus the window, `C = retain * n` (a fraction, or
a whole token count) but at least the window. Prefill compute is unchanged; only the cache shrinks.

`gqa=false` is the reference: selection per query head, after expanding grouped K/V, so the
cache holds one copy per query head. `gqa=true` sums the scores over each KV head's query
heads and keeps one set per KV head: the memory-honest variant for grouped-query models.
Defaults are the authors' (window 32, kernel 5, average pooling); `retain` defaults to 0.1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speedkv.core.policy import LayerView, PromptInfo
from speedkv.core.registry import register
from speedkv.methods.retention import (
    ScoredRetention,
    check_window_options,
    layer_window_scores,
    window_budget,
)
from speedkv.methods.scoring import check_budget, group_heads


@register
class SnapKV(ScoredRetention):
    name = "snapkv"
    degenerate_specs = ("snapkv:retain=1", "snapkv:retain={T},gqa=true")

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
        check_window_options(config.window, config.kernel, config.pool)
        self.n = 0

    def begin(self, prompt: PromptInfo) -> None:
        self.n = prompt.n

    def query_window(self, layer: int) -> int:
        return self.config.window

    def retained(self, layer: int, n: int) -> int:
        return window_budget(self.config.retain, n, self.config.window, "retain")

    def entry_scores(self, layer: int, view: LayerView) -> torch.Tensor:
        cfg = self.config
        scores = layer_window_scores(view, cfg.window, cfg.kernel, cfg.pool)  # [Hq, n - w]
        return group_heads(scores, self.shape.num_kv_heads) if cfg.gqa else scores

    def summary(self) -> dict:
        return {"prompt_tokens": self.n, "kept": self.retained(0, self.n)}
