"""H2O (Zhang et al.): heavy hitters plus recent tokens, evicting during decode too.

Each KV head ranks its entries by accumulated attention: after prefill, the sum over every
prompt query of its softmax attention to the entry (query heads summed per KV head); then,
at each decode step, the new token's attention is added. The cache keeps the `recent` most
recent entries and the `heavy` best-ranked others; when a decode step pushes it past
`heavy + recent`, each head evicts its lowest-ranked non-recent entry.

Budgets are whole token counts (fixed caps) or fractions in (0, 1] of the tokens seen so far
(prompt and generated: `heavy=1` keeps everything). Defaults are the paper's 10% heavy
hitters and 10% recent tokens. The prefill scoring needs every prompt query's attention
weights, computed in chunks beside the fused attention kernel: H2O's extra prefill cost is
real and shows in its TTFT.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speedkv.core.policy import LayerView, Policy, PromptInfo
from speedkv.core.registry import register
from speedkv.methods.scoring import (
    attention_probs,
    attention_received,
    budget,
    check_budget,
    group_heads,
    top_plus_window,
)

_ALL = 1 << 30


@register
class H2O(Policy):
    name = "h2o"
    degenerate_specs = ("h2o:heavy=1,recent=1", "h2o:heavy={T},recent=4")

    @dataclass
    class Config:
        heavy: float = 0.1
        recent: float = 0.1

    def __init__(self, config: Config, shape):
        super().__init__(config, shape)
        check_budget(config.heavy, "heavy")
        check_budget(config.recent, "recent")
        self.scores: dict[int, torch.Tensor] = {}  # layer -> [Hkv, capacity], aligned with slots
        self.n = 0

    def begin(self, prompt: PromptInfo) -> None:
        self.scores, self.n = {}, prompt.n

    def budgets(self, seen: int) -> tuple[int, int]:
        return budget(self.config.heavy, seen, "heavy"), max(
            1, budget(self.config.recent, seen, "recent")
        )

    def query_window(self, layer: int) -> int:
        return _ALL

    def kept(self, layer: int, view: LayerView) -> torch.Tensor | None:
        q, q_pos = view.queries()
        k_pos = view.kv.positions()[0]
        received = attention_received(q, q_pos, view.kv.keys(), k_pos)
        accumulated = group_heads(received, self.shape.num_kv_heads)  # [Hkv, n]
        n = k_pos.numel()
        heavy, recent = self.budgets(self.n)
        # the heavy hitters among the older entries, and the recent ones
        index = top_plus_window(accumulated[:, : n - recent], heavy + recent, n)
        spare = view.kv.capacity - n
        scores = torch.zeros(accumulated.shape[0], index.shape[1] + spare, device=q.device)
        scores[:, : index.shape[1]] = torch.gather(accumulated, 1, index)
        self.scores[layer] = scores
        return None if index.shape[1] == n else index

    def after_decode(self, layer: int, q: torch.Tensor, kv) -> None:
        n = kv.length
        scores = self.scores.get(layer)
        if scores is None:
            return
        if scores.shape[1] < n:  # more tokens than reserved for
            scores = torch.cat([scores, scores.new_zeros(scores.shape[0], n)], 1)
            self.scores[layer] = scores
        probs = attention_probs(q, None, kv.keys(), None)[:, 0]  # every entry is earlier
        scores[:, :n] += group_heads(probs, kv.k.shape[0])
        seen = int(kv.pos[0, n - 1]) + 1
        heavy, recent = self.budgets(seen)
        if n <= heavy + recent:
            return
        pos = kv.positions()
        protected = pos >= seen - recent  # the recent window is never evicted
        victims = scores[:, :n].masked_fill(protected, float("inf")).argmin(-1)
        heads = torch.arange(scores.shape[0], device=scores.device)
        scores[heads, victims] = scores[:, n - 1].clone()
        kv.evict(victims)

    def summary(self) -> dict:
        heavy, recent = self.budgets(self.n)
        return {"prompt_tokens": self.n, "heavy": heavy, "recent": recent}
