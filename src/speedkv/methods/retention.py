"""Score-then-keep retention: after a layer's prefill, each head keeps its best-scored entries
up to a budget, plus a protected tail of the most recent ones that is always kept.

`ScoredRetention` is the base for the methods that compress the cache this way (SnapKV,
FastKV): a method says how many of a layer's entries stay (`retained`) and scores the
entries before the tail (`entry_scores`); the base chooses. H2O's prefill selection and the
token choices of FastKV's TSP and PyramidInfer make the same choice with their own scores
(`scoring.top_plus_window`, `keep_mask`). Also here: the observation-window scoring of
SnapKV and FastKV.
"""

from __future__ import annotations

import torch

from speedkv.core.policy import LayerView, Policy
from speedkv.errors import UserError
from speedkv.methods.scoring import budget, top_plus_window, window_scores


class ScoredRetention(Policy):
    """A method whose cache keeps, per head, the best-scored entries of every layer."""

    def retained(self, layer: int, n: int) -> int:
        """How many of the n entries layer `layer` keeps (n or more: all of them)."""
        raise NotImplementedError

    def entry_scores(self, layer: int, view: LayerView) -> torch.Tensor:
        """Scores [heads, p] of the layer's first p entries; the n - p after them are the
        protected tail. heads = KV heads, or query heads for per-query-head retention."""
        raise NotImplementedError

    def kept(self, layer: int, view: LayerView) -> torch.Tensor | None:
        n = view.kv.length
        keep = self.retained(layer, n)
        if keep >= n:
            return None  # nothing to drop: no scores needed
        return top_plus_window(self.entry_scores(layer, view), keep, n)


def keep_mask(prefix_scores: torch.Tensor, keep: int, n: int) -> torch.Tensor:
    """Bool [n]: the best `keep - (n - p)` of the first p entries (scores [p]) and the last
    n - p, as one row of `top_plus_window`."""
    mask = torch.zeros(n, dtype=torch.bool, device=prefix_scores.device)
    mask[top_plus_window(prefix_scores[None], keep, n)[0]] = True
    return mask


# -- observation-window scoring (SnapKV, FastKV) ------------------------------------------------
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
