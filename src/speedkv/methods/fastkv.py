"""FastKV (Jo et al.): Token-Selective Propagation plus decoupled, per-KV-head KV retention.

Scores, in any layer: the last `window` prompt queries attend (float32 softmax, causal inside
the window) to every key; per token, sum over those queries, then 1-D pool along tokens
(`pool`, `kernel`). Grouped-query heads are summed per KV head.

- KV retention, every layer, prefill only: each KV head keeps its top `C - window` earlier
  entries plus the last `window`; `C = retain * n` of the layer's entries, at least the
  window (no compression when the layer holds fewer than C). Prefill attention itself uses
  the layer's uncompressed K/V.
- TSP at `tsp_layer`: scores summed over KV heads pick the top `T - window` tokens plus the
  last `window` (`T = tsp_rate * N`, at least the window); later layers run only on those
  tokens, at their original positions. Those layers retain `retain / tsp_rate` of their
  reduced length, so every layer ends near `retain * N` entries.

`retain` and `tsp_rate` are fractions in (0, 1] or whole token counts. Defaults are the
authors' (window 8, kernel 7, max-pool, TSP rate 0.2, retain 0.1); `tsp_layer` defaults to
their 15 of 32 layers scaled by depth (14 of 30 for SmolLM2). The paper's TSP-layer
selection is `speedkv calibrate-tsp`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speedkv.core.policy import LayerView, PromptInfo, Stream
from speedkv.core.registry import register
from speedkv.methods.common import resolve_layer
from speedkv.methods.retention import (
    ScoredRetention,
    check_window_options,
    keep_mask,
    layer_window_scores,
    window_budget,
)
from speedkv.methods.scoring import budget, check_budget, group_heads


@register
class FastKV(ScoredRetention):
    name = "fastkv"
    degenerate_specs = ("fastkv:tsp_rate=1,retain=1", "fastkv:tsp_layer=5,tsp_rate={T},retain={T}")

    @dataclass
    class Config:
        tsp_layer: int | None = None
        tsp_rate: float = 0.2
        retain: float = 0.1
        window: int = 8
        kernel: int = 7
        pool: str = "max"

    def __init__(self, config: Config, shape):
        super().__init__(config, shape)
        config.tsp_layer = resolve_layer(config.tsp_layer, 15, shape, "tsp_layer")
        check_budget(config.tsp_rate, "tsp_rate")
        check_budget(config.retain, "retain")
        check_window_options(config.window, config.kernel, config.pool)
        self.n = 0
        self.selected: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None
        self.kept_per_layer: list[int] = []

    def begin(self, prompt: PromptInfo) -> None:
        self.n, self.selected, self.kept_per_layer = prompt.n, None, []

    def query_window(self, layer: int) -> int:
        return self.config.window

    def observe(self, layer: int, view: LayerView) -> None:
        cfg = self.config
        n = view.kv.length
        self.scores = layer_window_scores(view, cfg.window, cfg.kernel, cfg.pool)  # [Hq, n - w]
        if layer == cfg.tsp_layer:
            keep = window_budget(cfg.tsp_rate, self.n, cfg.window, "tsp_rate")
            if keep < n:
                self.selected = keep_mask(self.scores.sum(0), keep, n)

    def computed(self, layer: int, stream: Stream) -> torch.Tensor | None:
        return self.selected if layer == self.config.tsp_layer + 1 else None

    def kept(self, layer: int, view: LayerView) -> torch.Tensor | None:
        n = view.kv.length
        self.kept_per_layer.append(min(self.retained(layer, n), n))
        return super().kept(layer, view)

    def entry_scores(self, layer: int, view: LayerView) -> torch.Tensor:
        return group_heads(self.scores, self.shape.num_kv_heads)  # observed with the layer

    def retained(self, layer: int, n: int) -> int:
        """Entries layer `layer` keeps out of its n (never fewer than the window)."""
        return max(self._retain_budget(layer, n), min(self.config.window, n))

    def _retain_budget(self, layer: int, n: int) -> int:
        cfg = self.config
        if cfg.retain > 1:
            return min(int(cfg.retain), n)
        if layer <= cfg.tsp_layer or self.selected is None:
            return budget(cfg.retain, n, "retain")
        if cfg.tsp_rate > 1:  # TSP kept a token count: retain the same share of the prompt
            return min(n, int(self.n * cfg.retain))
        return int(n * min(1.0, cfg.retain / cfg.tsp_rate))

    def summary(self) -> dict:
        tsp = int(self.selected.sum()) if self.selected is not None else self.n
        return {"prompt_tokens": self.n, "tsp_tokens": tsp, "kept_per_layer": self.kept_per_layer}
