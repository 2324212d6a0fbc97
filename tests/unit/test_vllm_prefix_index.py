"""The vLLM backend's prefix index for the upper layers' compact blocks, without vLLM: which
record a lookup takes, and what it drops. The pool stands in for vLLM's block pool by the one
call the index makes of it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from speedkv.vllm.prefix_index import (
    FRESH,
    CompactPrefixIndex,
    Record,
    block_key,
    index_of,
    state_after,
)

ALIGN = 4  # tokens per block boundary in these tests


@dataclass(frozen=True)
class Block:
    block_id: int


class Pool:
    """Cached blocks by key, one group; `evict` drops a block's key as vLLM's pool does."""

    hash_block_size = ALIGN

    def __init__(self) -> None:
        self.cached: dict[bytes, Block] = {}

    def put(self, key: bytes, block_id: int) -> None:
        self.cached[key] = Block(block_id)

    def evict(self, key: bytes) -> None:
        del self.cached[key]

    def get_cached_block(self, key: bytes, group_ids: list[int]) -> list[Block] | None:
        block = self.cached.get(key)
        return None if block is None else [block] * len(group_ids)


def tokens(n: int) -> list[bytes]:
    """Chained token hashes of n boundaries (stand-ins)."""
    return [f"tokens-{i}".encode() for i in range(n)]


def test_the_longest_boundary_whose_blocks_are_all_cached_wins():
    pool, index, hashes = Pool(), CompactPrefixIndex(), tokens(4)
    for boundary, rows, block in [(1, 1, 10), (2, 1, 10), (3, 5, 11)]:
        key = f"k{boundary}".encode()
        pool.put(key, block)
        index.add(hashes[boundary - 1], Record(f"s{boundary}".encode(), rows, (key,)))
    blocks, hit = index.longest_hit(hashes, 4 * ALIGN, [0], pool, ALIGN)
    assert hit == 3 * ALIGN and blocks == ([Block(11)],)
    assert index.hit(hit, blocks[0]).rows == 5  # what the allocation asks next
    # max_length caps the lookup (vLLM never reuses a prompt's last token)
    blocks, hit = index.longest_hit(hashes, 3 * ALIGN - 1, [0], pool, ALIGN)
    assert hit == 2 * ALIGN


def test_a_windowed_group_takes_only_anchor_rows_past_the_bound():
    """`max_rows` passes over records holding more rows than the anchors (a chat's earlier
    deep rows) for a shorter boundary; `min_boundary` stops the search below the window rule's
    bound. Records skipped this way stay for the groups that may reuse them."""
    pool, index, hashes = Pool(), CompactPrefixIndex(), tokens(5)
    for boundary, rows in [(1, 2), (2, 2), (3, 2), (4, 9)]:  # deep rows from boundary 4 on
        key = f"k{boundary}".encode()
        pool.put(key, boundary)
        index.add(hashes[boundary - 1], Record(f"s{boundary}".encode(), rows, (key,)))
    _, hit = index.longest_hit(hashes, 5 * ALIGN, [0], pool, ALIGN)
    assert hit == 4 * ALIGN
    blocks, hit = index.longest_hit(hashes, 5 * ALIGN, [0], pool, ALIGN, max_rows=2)
    assert hit == 3 * ALIGN and blocks == ([Block(3)],)
    _, hit = index.longest_hit(hashes, 5 * ALIGN, [0], pool, ALIGN, max_rows=2,
                               min_boundary=3 * ALIGN + 1)  # fmt: skip
    assert hit == 0
    assert index.candidates(hashes[3])  # the deep-row record is kept


def test_a_record_with_an_evicted_block_is_skipped_and_dropped():
    pool, index, hashes = Pool(), CompactPrefixIndex(), tokens(2)
    pool.put(b"a", 1)
    pool.put(b"b", 2)
    index.add(hashes[0], Record(b"s1", 1, (b"a",)))
    index.add(hashes[1], Record(b"s2", 130, (b"a", b"b")))  # two blocks: a full one, a part
    pool.evict(b"b")
    blocks, hit = index.longest_hit(hashes, 2 * ALIGN, [0, 1], pool, ALIGN)
    assert hit == ALIGN and blocks == ([Block(1)], [Block(1)])  # one list per group
    assert index.candidates(hashes[1]) == []  # forgotten


def test_histories_of_one_prefix_are_kept_apart_most_recent_first():
    index = CompactPrefixIndex()
    older, newer = Record(b"first", 1, (b"x",)), Record(b"second", 9, (b"y",))
    index.add(b"t", older)
    index.add(b"t", newer)
    assert index.candidates(b"t") == [newer, older]
    index.add(b"t", Record(b"first", 1, (b"x",)))  # the same history again: moved to the front
    assert [r.state for r in index.candidates(b"t")] == [b"first", b"second"]


def test_a_hit_nobody_looked_up_is_an_error():
    with pytest.raises(RuntimeError, match="no record of a 8-token hit"):
        CompactPrefixIndex().hit(8, [Block(3)])


def test_no_hit_gives_empty_blocks_for_every_group():
    blocks, hit = CompactPrefixIndex().longest_hit(tokens(3), 12, [0, 1, 2], Pool(), ALIGN)
    assert hit == 0 and blocks == ([], [], [])


def test_states_and_keys_name_tokens_history_and_place():
    # a deep suffix that starts after the boundary does not show in the state: requests whose
    # futures differ share the prefix
    assert state_after(FRESH, b"t", 50, 8) == state_after(FRESH, b"t", 90, 8)
    assert state_after(FRESH, b"t", 5, 8) != state_after(FRESH, b"t", 6, 8)
    assert state_after(FRESH, b"t", 5, 8) != state_after(b"other", b"t", 5, 8)
    # a part-filled block's key names its row count; a full block's does not depend on rows
    # past it
    assert block_key(b"s", 0, 3, 128) != block_key(b"s", 0, 4, 128)
    assert block_key(b"s", 0, 200, 128) == block_key(b"s", 0, 300, 128)


def test_one_index_per_pool():
    first, second = Pool(), Pool()
    assert index_of(first) is index_of(first)
    assert index_of(first) is not index_of(second)
