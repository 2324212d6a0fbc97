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

On a model with a sliding window, a prompt whose anchors would still be inside its first deep
token's window runs wholly at full depth (`SpeedRule.deep_for`); any other request's deep rows
see no anchor in a windowed layer. An upper windowed layer then sees a run of consecutive deep
rows, and its kernel's own window over compact indices is the window over positions, provided
the deep rows start a run of their own: in a windowed group the anchors fill a block of their
own, and each request's step splits into an anchor segment and a deep segment, the latter
reading its block table from the block after the anchors' (`segmented`).

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
    # [k] blocks of its request's table each entry skips (`segmented`: an entry is then a
    # segment of a request, and `requests` may repeat); None: every entry starts at block 0
    block_offset: torch.Tensor | None = None

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
        window: int | None = None,
    ) -> Layout:
        """The layout of requests with these prompt lengths. A request that reused
        `hit_tokens[i] > 0` tokens from the prefix cache holds `hit_rows[i]` compact rows for
        them, whatever depth history made them; its own deep suffix starts no earlier than its
        first new token. `window`: the model's widest sliding window (`deep_from`)."""
        prompt_lens = prompt_lens.long()
        deep_from = (prompt_lens - deep).clamp(min=0)
        if window is not None and anchors:
            deep_from = torch.where(deep_from < window + anchors - 1, 0, deep_from)
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
           hit_rows: int = 0, window: int | None = None) -> RequestLayout:  # fmt: skip
        deep_from = deep_from_of(prompt_len, anchors, deep, window)
        if hit_tokens > 0:
            return cls(max(deep_from, hit_tokens), hit_rows)
        return cls(deep_from, min(deep_from, anchors))

    def rows(self, seq_len: int, anchor_slots: int = 0) -> int:
        """Compact rows of the request once it holds `seq_len` tokens; with `anchor_slots`
        (a segmented group's) the anchors fill that many rows once a deep row follows them."""
        anchors = min(seq_len, self.compact_at)
        if anchor_slots and anchors and seq_len > self.deep_from:
            anchors = max(anchors, anchor_slots)
        return anchors + max(seq_len - self.deep_from, 0)


def deep_from_of(prompt_len: int, anchors: int, deep: int, window: int | None = None) -> int:
    """Where a prompt's full-depth suffix starts: `deep` tokens from its end, or at 0 on a
    model with a sliding window when an anchor would still be inside the window of the
    suffix's first token (speedkv.methods.speed.SpeedRule.deep_for, the same rule)."""
    deep_from = max(prompt_len - deep, 0)
    if window is not None and anchors and deep_from < window + anchors - 1:
        return 0
    return deep_from


def anchor_slots(anchors: int, block_size: int) -> int:
    """Rows the anchors fill in a segmented (windowed) group: whole blocks, so that the deep
    rows start a block."""
    return -(-anchors // block_size) * block_size


def compact_length(
    seq_lens: torch.Tensor, prompt_lens: torch.Tensor, anchors: int, deep: int
) -> torch.Tensor:
    """How many of the first `seq_lens` positions of fresh requests are full depth: the
    anchors that exist, plus every position from the deep suffix's start (or the anchors'
    end, if later)."""
    return Layout.of(prompt_lens, anchors, deep).length(seq_lens)


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


def segmented(batch: FullDepthRows, layout: Layout, seq_lens: torch.Tensor,
              block_size: int) -> FullDepthRows:  # fmt: skip
    """`batch` for a windowed group: each request's anchor rows and deep rows become segments
    of their own. An anchor segment sees the anchors; a deep segment sees the deep rows only,
    from the first block after the anchors' (`block_offset`), so its compact indices count from
    its first deep row and the kernel's window over them is the window over positions. Its rows
    are written after the anchors' whole blocks (`anchor_slots`)."""
    layout = layout.take(torch.arange(seq_lens.numel()))
    owner = batch.row_request
    compact_at = layout.compact_at[owner]
    is_deep = batch.compact >= compact_at
    anchored = compact_at > 0
    skip = torch.where(anchored, -(-compact_at // block_size), 0)  # blocks the anchors fill
    compact = torch.where(is_deep, skip * block_size + batch.compact - compact_at, batch.compact)
    segment = owner * 2 + is_deep.long()
    keys, counts = torch.unique_consecutive(segment, return_counts=True)
    requests, deep = keys // 2, (keys % 2).bool()
    query = torch.zeros(keys.numel() + 1, dtype=torch.int32)
    query[1:] = counts.cumsum(0)
    lengths = seq_lens[requests].long()
    request_layout = layout.take(requests)
    anchors_seen = torch.minimum(lengths, request_layout.compact_at)
    deep_seen = (lengths - request_layout.deep_from).clamp(min=0)
    first_row = query[:-1].long()
    return FullDepthRows(
        rows=batch.rows,
        compact=compact,
        row_request=owner,
        requests=requests,
        query_start=query,
        seq_lens=torch.where(deep, deep_seen, anchors_seen).int(),
        block_offset=torch.where(deep, skip[first_row], 0),
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
    if batch.block_offset is not None:
        needed = needed + batch.block_offset
    held = blocks_held[batch.requests].long()
    return batch.requests[needed > held].unique()
