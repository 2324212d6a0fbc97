"""Where SPEED's full-depth tokens sit in one vLLM step.

vLLM flattens the tokens a step computes, request after request, into one row each. Under SPEED
only the full-depth rows -- the anchors, the last `deep` prompt tokens and every generated token
-- enter the layers >= lcut. Those layers store a request's K/V compactly: its c-th full-depth
token goes to slot c of the request's own blocks (c <= position, so that block already exists).
The stock kernel, run causally over the compact lengths, then shows each query exactly the
anchors and the earlier full-depth tokens: SPEED's rule (`speedkv.methods.speed.SpeedRule`).

A request that starts from vLLM's prefix cache keeps the depth each reused token was first
computed at (docs/reuse.md): its cached compact rows stay as they are, and the rule applies to
its new tokens. Both cases come down to two numbers per request (`Layout`): the position from
which every token is full depth, and the compact index of that position.

Pure torch, so the rule is tested without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FullDepthRows:
    """The part of one step that runs the upper layers."""

    rows: torch.Tensor  # [n] rows of the step's tokens, ascending
    compact: torch.Tensor  # [n] each row's compact index inside its request
    row_request: torch.Tensor  # [n] each row's request (index into the step's requests)
    requests: torch.Tensor  # [k] requests with at least one full-depth row, ascending
    query_start: torch.Tensor  # [k + 1] where each kept request's rows start
    seq_lens: torch.Tensor  # [k] compact length of each kept request after this step

    @property
    def count(self) -> int:
        return int(self.rows.numel())


@dataclass(frozen=True)
class Layout:
    """Where each request's full-depth rows go: position p is full depth when
    `p < compact_at` (the anchors of a fresh request) or `p >= deep_from`, and its compact
    index is p, or `compact_at + p - deep_from`. Tensors of one entry per request."""

    deep_from: torch.Tensor
    compact_at: torch.Tensor

    @classmethod
    def of(
        cls,
        prompt_lens: torch.Tensor,
        anchors: int,
        deep: int,
        hit_tokens: torch.Tensor | None = None,
        hit_rows: torch.Tensor | None = None,
    ) -> Layout:
        """The layout of requests with these prompt lengths. A request that reused
        `hit_tokens[i] > 0` tokens from the prefix cache holds `hit_rows[i]` compact rows for
        them, whatever depth history made them; its own deep suffix starts no earlier than its
        first new token."""
        prompt_lens = prompt_lens.long()
        deep_from = (prompt_lens - deep).clamp(min=0)
        fresh_at = deep_from.clamp(max=anchors)
        if hit_tokens is None:
            return cls(deep_from, fresh_at)
        hit_tokens, hit_rows = hit_tokens.long(), hit_rows.long()
        reused = hit_tokens > 0
        return cls(
            torch.where(reused, torch.maximum(deep_from, hit_tokens), deep_from),
            torch.where(reused, hit_rows, fresh_at),
        )

    def length(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """Compact rows of requests that hold `seq_lens` tokens."""
        seq_lens = seq_lens.long()
        return torch.minimum(seq_lens, self.compact_at) + (seq_lens - self.deep_from).clamp(min=0)

    def take(self, index: torch.Tensor) -> Layout:
        return Layout(self.deep_from[index], self.compact_at[index])


@dataclass(frozen=True)
class RequestLayout:
    """`Layout` of one request in plain ints: the KV manager asks it for every request at
    every step, where building tensors would cost the scheduler a tenth of a millisecond."""

    deep_from: int
    compact_at: int

    @classmethod
    def of(cls, prompt_len: int, anchors: int, deep: int, hit_tokens: int = 0,
           hit_rows: int = 0) -> RequestLayout:  # fmt: skip
        deep_from = max(prompt_len - deep, 0)
        if hit_tokens > 0:
            return cls(max(deep_from, hit_tokens), hit_rows)
        return cls(deep_from, min(deep_from, anchors))

    def rows(self, seq_len: int) -> int:
        """Compact rows of the request once it holds `seq_len` tokens."""
        return min(seq_len, self.compact_at) + max(seq_len - self.deep_from, 0)


def compact_length(
    seq_lens: torch.Tensor, prompt_lens: torch.Tensor, anchors: int, deep: int
) -> torch.Tensor:
    """How many of the first `seq_lens` positions of fresh requests are full depth: the
    anchors that exist, plus every position from the deep suffix's start (or the anchors'
    end, if later)."""
    return Layout.of(prompt_lens, anchors, deep).length(seq_lens)


def full_depth_count(seq_len: int, prompt_len: int, anchors: int, deep: int) -> int:
    """`compact_length` of one request."""
    return RequestLayout.of(prompt_len, anchors, deep).rows(seq_len)


def step_positions(query_start: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Each row's position, from the CPU-side facts of a step: request i's rows are its
    positions `seq_lens[i] - query_len` up to `seq_lens[i] - 1`, in order. vLLM's V1 runner
    lays a step out this way for text models without speculative decoding, so the builder
    never reads the device's positions back (a host sync on a GPU)."""
    query_lens = (query_start[1:] - query_start[:-1]).long()
    first = seq_lens[: query_lens.numel()].long() - query_lens
    request = torch.repeat_interleave(torch.arange(query_lens.numel()), query_lens)
    offset = torch.arange(int(query_lens.sum())) - query_start[:-1].long()[request]
    return first[request] + offset


def full_depth_rows(
    positions: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    layout: Layout,
) -> FullDepthRows:
    """The full-depth rows of a step whose requests own rows `query_start[i]:query_start[i+1]`
    (positions given per row) and reach `seq_lens[i]` tokens, laid out by `layout` (one entry
    per request of the step)."""
    num_reqs = query_start.numel() - 1
    query_lens = query_start[1:] - query_start[:-1]
    request = torch.repeat_interleave(torch.arange(num_reqs), query_lens)
    positions = positions[: int(query_start[-1])].long()
    layout = layout.take(torch.arange(num_reqs))
    deep_from, compact_at = layout.deep_from[request], layout.compact_at[request]
    full = (positions < compact_at) | (positions >= deep_from)
    rows = full.nonzero().squeeze(1)
    row_request = request[rows]
    row_pos = positions[rows]
    compact = torch.where(
        row_pos < compact_at[rows], row_pos, compact_at[rows] + row_pos - deep_from[rows]
    )
    counts = torch.bincount(row_request, minlength=num_reqs)
    requests = (counts > 0).nonzero().squeeze(1)
    query = torch.zeros(requests.numel() + 1, dtype=torch.int32)
    query[1:] = counts[requests].cumsum(0)
    lengths = layout.length(seq_lens[:num_reqs])
    return FullDepthRows(
        rows=rows,
        compact=compact,
        row_request=row_request,
        requests=requests,
        query_start=query,
        seq_lens=lengths[requests].int(),
    )


def compact_slots(block_table: torch.Tensor, batch: FullDepthRows, block_size: int) -> torch.Tensor:
    """The cache slot of each full-depth row: compact index c of request r lives at
    `block_table[r, c // block_size] * block_size + c % block_size`, in the KV manager's
    blocks, the unit of vLLM's slot mappings. (An attention kernel with smaller blocks sees
    manager block b as kernel blocks `b * m + j`: the same slots.)"""
    blocks = block_table[batch.row_request, batch.compact // block_size].long()
    return blocks * block_size + batch.compact % block_size


def requests_short_of_blocks(
    batch: FullDepthRows, blocks_held: torch.Tensor, block_size: int
) -> torch.Tensor:
    """The requests (indices into the step's requests) whose compact rows after this step
    need more blocks than the KV manager gave them (`blocks_held[i]` blocks of `block_size`
    slots): writing their K/V would land in blocks nobody allocated."""
    needed = (batch.seq_lens.long() + block_size - 1) // block_size
    held = blocks_held[batch.requests].long()
    return batch.requests[needed > held]
