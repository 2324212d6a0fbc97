"""Prefix caching for the upper layers' compact blocks: which cached blocks hold the full-depth
rows of a token prefix, and how many rows that is.

vLLM finds a cached prefix by the chained hashes of its token blocks, and every stock group holds
one block per `block_size` tokens, so a hit of `h` tokens is `h / block_size` blocks. The upper
layers' compact group holds only the full-depth rows, in order, and how many of the first `h`
tokens are full depth depends on the prefix's history, not on its tokens: a token keeps the
depth it was first computed at (an earlier request's deep suffix and its generated tokens stay
deep). So the index keeps, for each token boundary a request passed, one record per history:

    token hash at the boundary -> (state, compact rows, the keys of the blocks holding them)

A state names the tokens and the depth history up to the boundary; a block's key names the
state it was written under and its place, so blocks of two histories never mix. The blocks are
registered in vLLM's own block pool under those keys, and a lookup takes a record only while
every one of its blocks is still cached there: eviction needs no bookkeeping here. The last
block of a record is usually part-filled; the request that hits it gets a private copy (vLLM's
copy-on-write for partial hits) and writes its own rows after the reused ones.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from dataclasses import dataclass

# records kept per pool; a record whose blocks were evicted is skipped, then dropped
MAX_RECORDS = 1 << 16
FRESH = b"speedkv-fresh"  # the state a request without a prefix hit starts from


def digest(*parts: object) -> bytes:
    """A stable hash of ints, bytes and None (pickle of such tuples is deterministic)."""
    return hashlib.sha256(pickle.dumps(parts, protocol=4)).digest()


@dataclass(frozen=True)
class Record:
    """The upper layers' rows of a token prefix under one history."""

    state: bytes
    rows: int  # compact rows of the prefix
    keys: tuple[bytes, ...]  # one per block holding them, in order


def state_after(base: bytes, token_hash: bytes, deep_from: int, boundary: int) -> bytes:
    """The state at `boundary` of a request that started from state `base` and runs every
    token from `deep_from` on at full depth (none before the boundary if it is later): the
    tokens (their chained hash) and which of them are full depth."""
    return digest(base, token_hash, deep_from if deep_from < boundary else None)


def block_key(state: bytes, index: int, rows: int, block_size: int) -> bytes:
    """The key of block `index` of a record with `rows` rows: a full block is named by the
    first state that filled it, a part-filled one by its state and row count."""
    filled = min(block_size, rows - index * block_size)
    return digest(state, index, filled)


class CompactPrefixIndex:
    """The records of one block pool, least recently used first out, and the hits it handed
    out (vLLM looks a prefix up, then allocates for it, naming the hit by its blocks)."""

    def __init__(self, max_records: int = MAX_RECORDS) -> None:
        self.max_records = max_records
        self._records: OrderedDict[bytes, list[Record]] = OrderedDict()
        self._hits: OrderedDict[tuple[int, tuple[int, ...]], Record] = OrderedDict()

    def longest_hit(self, block_hashes, max_length: int, group_ids: list[int], block_pool,
                    alignment: int, max_rows: int | None = None,
                    min_boundary: int = 0) -> tuple[tuple[list, ...], int]:  # fmt: skip
        """The cached blocks of each group in `group_ids` for the longest boundary up to
        `max_length` (a multiple of `alignment`) with a record whose blocks are all cached,
        and that boundary; no blocks and 0 if there is none. `max_rows` and `min_boundary`
        narrow the records a windowed group may reuse (`kv_spec.SpeedUpperManager`)."""
        hash_size = block_pool.hash_block_size
        for boundary in range(max_length - max_length % alignment, 0, -alignment):
            if boundary < min_boundary:
                break
            token_hash = block_hashes[boundary // hash_size - 1]
            for record in self.candidates(token_hash):
                if max_rows is not None and record.rows > max_rows:
                    continue
                found: list[list] = [[] for _ in group_ids]
                for key in record.keys:
                    blocks = block_pool.get_cached_block(key, group_ids)
                    if blocks is None:
                        self.forget(token_hash, record)
                        break
                    for held, block in zip(found, blocks):
                        held.append(block)
                else:
                    for held in found:
                        self._remember(boundary, held, record)
                    return tuple(found), boundary
        return tuple([] for _ in group_ids), 0

    def _remember(self, boundary: int, blocks: list, record: Record) -> None:
        self._hits[(boundary, tuple(b.block_id for b in blocks))] = record
        while len(self._hits) > 4096:
            self._hits.popitem(last=False)

    def hit(self, boundary: int, blocks) -> Record:
        """The record a lookup found for a hit of `boundary` tokens on `blocks`."""
        found = self._hits.get((boundary, tuple(b.block_id for b in blocks)))
        if found is None:
            raise RuntimeError(
                f"SPEED's prefix index has no record of a {boundary}-token hit on these blocks"
            )
        return found

    def __len__(self) -> int:
        return sum(len(v) for v in self._records.values())

    def add(self, token_hash: bytes, record: Record) -> None:
        kept = [r for r in self._records.pop(token_hash, []) if r.state != record.state]
        self._records[token_hash] = [record, *kept][:4]  # a few histories per prefix
        while len(self._records) > self.max_records:
            self._records.popitem(last=False)

    def candidates(self, token_hash: bytes) -> list[Record]:
        found = self._records.get(token_hash)
        if found is None:
            return []
        self._records.move_to_end(token_hash)
        return list(found)

    def forget(self, token_hash: bytes, record: Record) -> None:
        """Drop a record whose blocks are gone."""
        kept = [r for r in self._records.get(token_hash, []) if r is not record]
        if kept:
            self._records[token_hash] = kept
        else:
            self._records.pop(token_hash, None)


def index_of(block_pool) -> CompactPrefixIndex:
    """The index of a block pool, made on first use (one pool per engine)."""
    index = getattr(block_pool, "_speedkv_prefix_index", None)
    if index is None:
        index = CompactPrefixIndex()
        block_pool._speedkv_prefix_index = index
    return index
