"""A per-sequence KV cache that holds, per layer, only what that layer materialised.

Each layer owns preallocated key/value buffers `[kv_heads, capacity, head_dim]` and the
absolute position of every entry (`[kv_heads, capacity]`: per head, because head-wise
retention methods keep different tokens in different heads). Entries `[0, length)` are live.
Layers are independent: under SPEED a lower layer holds the whole prompt while an upper layer
holds only anchors and decode-phase tokens, and the byte count says exactly that.

`nbytes` counts the keys and values of live entries; `allocated_bytes` counts the buffers that
exist (live entries plus the room reserved for tokens still to be generated). Positions are
bookkeeping (4 bytes per entry and head) and are counted by neither.
"""

from __future__ import annotations

import torch


class LayerKV:
    """Keys and values of one layer of one sequence, with room for `capacity` entries."""

    def __init__(self, heads: int, capacity: int, dim: int, dtype: torch.dtype, device):
        self.k = torch.empty((heads, capacity, dim), dtype=dtype, device=device)
        self.v = torch.empty((heads, capacity, dim), dtype=dtype, device=device)
        self.pos = torch.empty((heads, capacity), dtype=torch.int32, device=device)
        self.length = 0

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

    def write_next(self, k: torch.Tensor, v: torch.Tensor, position: int) -> None:
        """Put one token's k, v ([heads, 1, dim]) in the next free slot without committing it.

        The caller attends over `length + 1` entries, then calls `commit()` if the token stays.
        """
        if self.length == self.capacity:
            self._grow()
        self.k[:, self.length] = k[:, 0]
        self.v[:, self.length] = v[:, 0]
        self.pos[:, self.length] = position

    def commit(self) -> None:
        self.length += 1

    def keep(self, index: torch.Tensor) -> None:
        """Keep only the live entries at `index` ([m] or [heads, m]) and shrink the buffers
        to fit them plus the room that was reserved for decode tokens."""
        heads, _, dim = self.k.shape
        if index.dim() == 1:
            index = index.expand(heads, -1)
        spare = self.capacity - self.length
        gather = index.unsqueeze(-1).expand(-1, -1, dim)
        k = torch.gather(self.keys(), 1, gather)
        v = torch.gather(self.values(), 1, gather)
        pos = torch.gather(self.positions(), 1, index)
        self.__init__(heads, index.shape[1] + spare, dim, self.k.dtype, self.k.device)
        self.extend(k, v, pos)

    def nbytes(self) -> int:
        return 2 * self.k.shape[0] * self.length * self.k.shape[2] * self.k.element_size()

    def allocated_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def _grow(self) -> None:
        # Only reached when more tokens arrive than were reserved for; double the room.
        heads, cap, dim = self.k.shape
        extra = max(16, cap)
        self.k = torch.cat([self.k, self.k.new_empty((heads, extra, dim))], 1)
        self.v = torch.cat([self.v, self.v.new_empty((heads, extra, dim))], 1)
        self.pos = torch.cat([self.pos, self.pos.new_empty((heads, extra))], 1)


class KVCache:
    """The layers of one sequence's cache."""

    def __init__(self, layers: list[LayerKV]):
        self.layers = layers

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def allocated_bytes(self) -> int:
        return sum(layer.allocated_bytes() for layer in self.layers)

    def lengths(self) -> list[int]:
        return [layer.length for layer in self.layers]
