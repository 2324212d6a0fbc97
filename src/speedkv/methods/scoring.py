"""Token-importance helpers shared by the methods that pick tokens or cache entries.

All scores are float32. Shapes: `heads` is query heads unless a function says it groups them
into KV heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from speedkv.errors import UserError
from speedkv.hf.backbone import in_window


def budget(value: float, n: int, what: str = "budget") -> int:
    """A ratio in (0, 1] of n, or a whole token count > 1 (capped at n)."""
    if value <= 0:
        raise UserError(f"{what} must be a fraction in (0, 1] or a token count, got {value:g}")
    if value <= 1:
        return int(n * value)
    if value != int(value):
        raise UserError(f"{what} above 1 is a token count and must be whole, got {value:g}")
    return min(int(value), n)


def check_budget(value: float, what: str) -> None:
    """Validate a ratio-or-count option at construction time."""
    budget(value, 1 << 30, what)


def scaled_layer(reference_layer: int, num_layers: int, reference_depth: int = 32) -> int:
    """An authors' layer index for a 32-layer model, scaled to this model's depth."""
    return min(num_layers - 1, round(reference_layer * num_layers / reference_depth))


def attention_probs(
    q: torch.Tensor,
    q_pos: torch.Tensor | None,
    k: torch.Tensor,
    k_pos: torch.Tensor | None,
    chunk: int = 256,
    window: int | None = None,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) of every query over the keys, float32.

    q: [Hq, w, D] post-rotary queries; k: [Hkv, n, D] (grouped heads expanded). With absolute
    positions q_pos [w] and k_pos [n], keys after a query are masked out, and with a sliding
    `window` so are keys before it; with None for both, every key is visible (a query that
    comes after all of them). Returns [Hq, w, n]. Queries go through in chunks to bound
    memory.
    """
    return torch.cat(list(_probs_by_chunk(q, q_pos, k, k_pos, chunk, window)), 1)


def attention_received(
    q: torch.Tensor,
    q_pos: torch.Tensor | None,
    k: torch.Tensor,
    k_pos: torch.Tensor | None,
    chunk: int = 256,
) -> torch.Tensor:
    """The attention each key receives, summed over the queries: `attention_probs` summed
    over its query axis, [Hq, n], without ever holding more than one chunk of it."""
    total = torch.zeros(q.shape[0], k.shape[1], device=q.device)
    for probs in _probs_by_chunk(q, q_pos, k, k_pos, chunk):
        total += probs.sum(1)
    return total


def _probs_by_chunk(q, q_pos, k, k_pos, chunk: int, window: int | None = None):
    group = q.shape[0] // k.shape[0]
    keys = k.float().repeat_interleave(group, 0) if group > 1 else k.float()
    scale = 1.0 / math.sqrt(q.shape[-1])
    for start in range(0, q.shape[1], chunk):
        qc = q[:, start : start + chunk].float()
        scores = torch.matmul(qc, keys.transpose(1, 2)) * scale
        if q_pos is not None:
            future = k_pos[None, :] > q_pos[start : start + chunk, None]
            if window is not None:
                future |= ~in_window(window, q_pos[start : start + chunk], k_pos)
            scores = scores.masked_fill(future, float("-inf"))
        yield torch.softmax(scores, -1)


def pool1d(scores: torch.Tensor, kernel: int, kind: str = "max") -> torch.Tensor:
    """Same-length 1-D pooling along the last dimension (padding kernel // 2)."""
    if kernel <= 1 or scores.shape[-1] == 0:  # nothing precedes a window covering the prompt
        return scores
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1])
    if kind == "max":
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    elif kind == "avg":
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        raise UserError(f"pool must be 'max' or 'avg', got '{kind}'")
    return pooled[..., : shape[-1]].reshape(shape)


def group_heads(scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum per-query-head scores [Hq, ...] over the query heads of each KV head -> [Hkv, ...]."""
    return scores.reshape(kv_heads, scores.shape[0] // kv_heads, *scores.shape[1:]).sum(1)


def top_plus_window(prefix_scores: torch.Tensor, keep: int, n: int) -> torch.Tensor:
    """Sorted indices of the best `keep - w` prefix entries plus the last w = n - p entries.

    prefix_scores: [rows, p] scores of entries 0..p-1 (the entries after them always stay).
    Returns [rows, keep], or every index when keep >= n.
    """
    rows, p = prefix_scores.shape
    device = prefix_scores.device
    if keep >= n:
        return torch.arange(n, device=device).expand(rows, n)
    tail = torch.arange(p, n, device=device).expand(rows, n - p)
    if keep <= n - p:
        return tail[:, n - p - keep :]
    chosen = torch.topk(prefix_scores, keep - (n - p), dim=-1).indices
    return torch.cat([chosen, tail], -1).sort(-1).values


def window_scores(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    k_pos: torch.Tensor,
    window: int,
    kernel: int,
    pool: str,
) -> torch.Tensor:
    """SnapKV / FastKV scores of the entries before the observation window: attention of the
    last `window` queries, summed over those queries, then pooled along tokens.

    k holds n entries whose last `window` are the window's own keys. Returns [Hq, n - window].
    """
    probs = attention_probs(q[:, -window:], q_pos[-window:], k, k_pos)
    return pool1d(probs[..., : k.shape[1] - window].sum(1), kernel, pool)
