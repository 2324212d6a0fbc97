"""The windowed groups' layout in the vLLM plugin (speedkv.vllm.compact, pure torch): the
window rule on prompt lengths, the anchor and deep segments of a step, their slots and the
blocks the KV manager gives them. vLLM runs it in tests/vllm_backend/test_vllm_sliding_window.py."""

import torch

from speedkv.methods.speed import SpeedRule
from speedkv.vllm.compact import (
    Layout,
    RequestLayout,
    compact_slots,
    full_depth_rows,
    requests_short_of_blocks,
    segmented,
    step_positions,
)

WINDOW, ANCHORS, DEEP, BLOCK = 16, 2, 3, 4


def test_the_window_rule_is_the_engines():
    rule = SpeedRule(2, ANCHORS, DEEP, window=WINDOW)
    lengths = torch.arange(1, 60)
    layout = Layout.of(lengths, ANCHORS, DEEP, window=WINDOW)
    for n, deep_from in zip(lengths.tolist(), layout.deep_from.tolist()):
        assert deep_from == n - rule.deep_for(n, DEEP)
        assert RequestLayout.of(n, ANCHORS, DEEP, window=WINDOW).deep_from == deep_from


def test_a_step_splits_into_anchor_and_deep_segments():
    """Three requests in one step: a short prompt (whole depth), a long prompt whole, and a
    long one decoding. Each segment's rows, lengths, block offsets and slots."""
    prompts = torch.tensor([10, 40, 30])
    seq_lens = torch.tensor([10, 40, 32])  # the third has generated two tokens
    query_start = torch.tensor([0, 10, 50, 51])
    positions = step_positions(query_start, seq_lens)
    layout = Layout.of(prompts, ANCHORS, DEEP, window=WINDOW)
    assert layout.deep_from.tolist() == [0, 37, 27]
    found = segmented(full_depth_rows(positions, query_start, seq_lens, layout), layout,
                      seq_lens, BLOCK)  # fmt: skip
    assert found.requests.tolist() == [0, 1, 1, 2]
    assert found.query_start.tolist() == [0, 10, 12, 15, 16]
    assert found.seq_lens.tolist() == [10, 2, 3, 5]  # whole; anchors; deep rows; deep rows
    assert found.block_offset.tolist() == [0, 0, 1, 1]
    # the deep rows start the block after the anchors' (slot 4), counting from 0 in it
    assert found.compact.tolist() == [*range(10), 0, 1, 4, 5, 6, 8]
    table = torch.tensor([[7, 8, 9], [3, 4, 5], [1, 2, 6]])
    slots = compact_slots(table, found, BLOCK)
    assert slots.tolist() == [*range(28, 38), 12, 13, 16, 17, 18, 24]
    # the decoding request's deep rows need the anchors' block and two more
    held = torch.tensor([3, 2, 2])
    assert requests_short_of_blocks(found, held, BLOCK).tolist() == [2]
    rows = [RequestLayout.of(int(p), ANCHORS, DEEP, window=WINDOW).rows(int(s), BLOCK)
            for p, s in zip(prompts, seq_lens)]  # fmt: skip
    assert rows == [10, 4 + 3, 4 + 5]
