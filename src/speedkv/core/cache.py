"""A per-sequence KV cache that holds, per layer, only what that layer materialised.

Each layer owns preallocated key/value buffers `[kv_heads, capacity, head_dim]` and the
absolute position of every entry (`[kv_heads, capacity]`: per head, because head-wise
retention methods keep different tokens in different heads). Entries `[0, length)` are live.
Layers are independent: under SPEED a lower layer holds the whole prompt while an upper layer
holds only anchors and decode-phase tokens, and the byte count says exactly that.

`nbytes` counts the keys and values of live entries; `allocated_bytes` counts the buffers that
exist (live entries plus the room reserved for tokens still to be generated). Positions are
bookkeeping (4 bytes per entry and head) and are counted by neither.

A layer with a sliding window attends only to the entries inside it (by position: a run of
slots from `window_start`, or a mask). A generating sequence under full attention or SPEED
drops the entries its window has left behind (`KVCache.drop_out_of_window`), as transformers'
cache does: after the prompt, then each time a quarter of a window more has fallen out. A layer
remembers where it dropped (`dropped_below`), so a later prompt reuses its cache only from a
position whose window finds every entry it needs (`KVCache.covers`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class LayerKV:
    """Keys and values of one layer of one sequence, with room for `capacity` entries."""

    def __init__(self, heads: int, capacity: int, dim: int, dtype: torch.dtype, device):
        self.k = torch.empty((heads, capacity, dim), dtype=dtype, device=device)
        self.v = torch.empty((heads, capacity, dim), dtype=dtype, device=device)
        self.pos = torch.empty((heads, capacity), dtype=torch.int32, device=device)
        self.length = 0
        self.reads = 0  # entries read by decode-phase queries, summed over steps
        self.dropped_below = 0  # entries at positions below this may have been dropped
        # whether the live entries are in increasing position order, the same in every head
        # (None: not checked since entries were last written out of decode order)
        self._ordered: bool | None = True

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def keys(self) -> torch.Tensor:
        return self.k[:, : self.length]

    def values(self) -> torch.Tensor:
        return self.v[:, : self.length]

    def positions(self) -> torch.Tensor:
        return self.pos[:, : self.length]

    def extend(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Append entries: k, v [heads, m, dim]; positions [m] or [heads, m]."""
        m = k.shape[1]
        while self.length + m > self.capacity:
            self._grow()
        end = self.length + m
        self.k[:, self.length : end] = k
        self.v[:, self.length : end] = v
        self.pos[:, self.length : end] = positions.to(torch.int32)
        self.length = end
        self._ordered = None

    def write_next(self, k: torch.Tensor, v: torch.Tensor, position: int) -> None:
        """Put one token's k, v ([heads, 1, dim]) in the next free slot without committing it.

        The caller attends over `length + 1` entries, then calls `commit()` if the token stays.
        """
        self.make_room()
        if k.shape[0] != self.k.shape[0]:  # a cache kept per query head (SnapKV without GQA)
            k = k.repeat_interleave(self.k.shape[0] // k.shape[0], 0)
            v = v.repeat_interleave(self.k.shape[0] // v.shape[0], 0)
        self.k[:, self.length] = k[:, 0]
        self.v[:, self.length] = v[:, 0]
        self.pos[:, self.length] = position

    def make_room(self) -> None:
        """Make sure the slot after the live entries exists (the next token's)."""
        if self.length == self.capacity:
            self._grow()

    def commit(self) -> None:
        # a decode token comes after every cached position, so the order is kept
        self.length += 1

    def in_order(self) -> bool:
        """Whether the live entries are in increasing position order, with the same positions
        in every head (so a window of positions is a run of slots). True for full attention
        and SPEED; not after eviction or per-head retention."""
        if self._ordered is None:
            p = self.positions()
            self._ordered = bool(((p[:, 1:] > p[:, :-1]).all() & (p == p[:1]).all()).item())
        return self._ordered

    def window_start(self, first: int) -> int | None:
        """The slot of the first live entry at position >= `first`, every later one being at
        such a position too; None where the entries are not in position order."""
        if not self.in_order():
            return None
        if self.length == 0:
            return 0
        bound = torch.tensor([first], dtype=self.pos.dtype, device=self.pos.device)
        return int(torch.searchsorted(self.pos[0, : self.length], bound))

    def keep(self, index: torch.Tensor) -> None:
        """Keep only the live entries at `index` ([m] or [heads, m]) and shrink the buffers
        to fit them plus the room that was reserved for decode tokens."""
        heads, _, dim = self.k.shape
        if index.dim() == 1:
            index = index.expand(heads, -1)
        spare = self.capacity - self.length
        keys, values, positions = self.keys(), self.values(), self.positions()
        if index.shape[0] != heads:  # per-query-head selection: one copy per query head
            group = index.shape[0] // heads
            keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
            positions = positions.repeat_interleave(group, 0)
            heads = index.shape[0]
        gather = index.unsqueeze(-1).expand(-1, -1, dim)
        k = torch.gather(keys, 1, gather)
        v = torch.gather(values, 1, gather)
        pos = torch.gather(positions, 1, index)
        reads, dropped_below = self.reads, self.dropped_below
        self.__init__(heads, index.shape[1] + spare, dim, self.k.dtype, self.k.device)
        self.extend(k, v, pos)
        self.reads, self.dropped_below = reads, dropped_below

    def drop_before(self, first: int) -> None:
        """Drop the live entries at positions below `first` (those a sliding window no longer
        reaches), keeping the room reserved for decode tokens. Only for entries in position
        order: anything else keeps them, and attention masks them by position."""
        if first <= self.dropped_below or not self.in_order():
            return
        start = self.window_start(first)
        self.dropped_below = first
        if start:
            self.keep(torch.arange(start, self.length, device=self.k.device))

    def evict(self, slots: torch.Tensor) -> None:
        """Drop one live entry per head (slots: [heads]); the last entry moves into its slot.

        Order inside the buffer carries no meaning in decode (keys are already rotated and
        every live entry is visible), so swap-removal keeps eviction O(1) per head.
        """
        heads = torch.arange(self.k.shape[0], device=self.k.device)
        last = self.length - 1
        self.k[heads, slots] = self.k[:, last].clone()
        self.v[heads, slots] = self.v[:, last].clone()
        self.pos[heads, slots] = self.pos[:, last].clone()
        self.length = last
        self._ordered = None

    def prefix(self, end: int, room: int) -> LayerKV:
        """A new layer holding a copy of the entries at positions < `end`, with room for
        `room` more: what a request extending a cached prefix starts from (the cached
        buffers are never written, so any number of requests can extend one prefix)."""
        heads, _, dim = self.k.shape
        wanted = self.positions()[0] < end  # entries are the same in every head
        count = int(wanted.sum())
        out = LayerKV(heads, count + room, dim, self.k.dtype, self.k.device)
        out.dropped_below = self.dropped_below
        if bool(wanted[:count].all()):  # in position order (as reusable methods write): a slice
            out.extend(self.k[:, :count], self.v[:, :count], self.pos[:, :count])
        else:
            keep = wanted.nonzero()[:, 0]
            out.extend(self.k[:, keep], self.v[:, keep], self.pos[:, keep])
        return out

    def snapshot(self) -> LayerKV:
        """A view of the live entries that later writes cannot change: it shares the buffers,
        and a sequence only ever writes past its live entries (or into new buffers when it
        grows). Not for methods that evict or rewrite entries during decode."""
        view = LayerKV.__new__(LayerKV)
        view.k, view.v, view.pos = self.k, self.v, self.pos
        view.length, view.reads, view._ordered = self.length, 0, self._ordered
        view.dropped_below = self.dropped_below
        return view

    def nbytes(self) -> int:
        return 2 * self.k.shape[0] * self.length * self.k.shape[2] * self.k.element_size()

    def allocated_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def is_view(self) -> bool:
        """Whether the buffers are part of larger ones (a recorded step packs a batch's
        buffers side by side, core/graph_decode.py): holding them holds the whole."""
        return self.k.untyped_storage().nbytes() > self.k.nbytes

    def grow_to(self, capacity: int) -> None:
        """Room for `capacity` entries (a smaller number changes nothing); the live entries
        move to new buffers, the new slots are uninitialised."""
        heads, cap, dim = self.k.shape
        extra = capacity - cap
        if extra <= 0:
            return
        self.k = torch.cat([self.k, self.k.new_empty((heads, extra, dim))], 1)
        self.v = torch.cat([self.v, self.v.new_empty((heads, extra, dim))], 1)
        self.pos = torch.cat([self.pos, self.pos.new_empty((heads, extra))], 1)

    def _grow(self) -> None:
        # Only reached when more tokens arrive than were reserved for; double the room.
        self.grow_to(self.capacity + max(16, self.capacity))


class KVCache:
    """The layers of one sequence's cache."""

    def __init__(self, layers: list[LayerKV]):
        self.layers = layers

    def distinct(self) -> list[LayerKV]:
        """Each buffer once: layers may share one cache (SwiftKV's AcrossKV)."""
        return list({id(layer): layer for layer in self.layers}.values())

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.distinct())

    def allocated_bytes(self) -> int:
        return sum(layer.allocated_bytes() for layer in self.distinct())

    def has_views(self) -> bool:
        """Whether any layer's buffers are part of larger ones (LayerKV.is_view)."""
        return any(layer.is_view() for layer in self.layers)

    def lengths(self) -> list[int]:
        return [layer.length for layer in self.layers]

    def prefix(self, end: int, room: int) -> KVCache:
        """Copies of every layer's entries at positions < `end` (see LayerKV.prefix); layers
        that share one buffer keep sharing it."""
        copies: dict[int, LayerKV] = {}
        return KVCache(
            [copies.setdefault(id(layer), layer.prefix(end, room)) for layer in self.layers]
        )

    def snapshot(self) -> KVCache:
        """The cache as it is now, unaffected by later decode steps (see LayerKV.snapshot)."""
        views: dict[int, LayerKV] = {}
        return KVCache([views.setdefault(id(layer), layer.snapshot()) for layer in self.layers])

    def drop_out_of_window(
        self, windows: Sequence[int | None], position: int, slack: bool = False
    ) -> bool:
        """Drop, in each layer with a window (`windows[i]`, None for none), the entries that
        the token at `position` and every later one no longer see. With `slack`, a layer drops
        only once a quarter of its window (at least 16 entries) has fallen out since it last
        did, so that decode copies a layer's entries rarely. Whether any layer dropped."""
        dropped = False
        for layer, window in zip(self.layers, windows):
            if window is None:
                continue
            first = position - window + 1
            wait = max(16, window // 4) if slack else 1
            if first - layer.dropped_below >= wait:
                before = layer.length
                layer.drop_before(first)
                dropped |= layer.length != before
        return dropped

    def covers(self, windows: Sequence[int | None], end: int) -> bool:
        """Whether a prompt continuing this cache at position `end` finds every entry its
        windows reach (none was dropped that a token at `end` would see)."""
        return all(
            layer.dropped_below <= (0 if window is None else max(0, end - window + 1))
            for layer, window in zip(self.layers, windows)
        )

    def decode_reads(self) -> int:
        """KV entries read by decode-phase queries, over all layers and steps."""
        return sum(layer.reads for layer in self.distinct())
