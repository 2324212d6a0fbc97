"""speedkv.bench.paired: the turn-about order and the paired arithmetic, on given figures (no
test here times anything)."""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest

from speedkv.bench.paired import paired_ratio, turn_about


def test_ratios_are_taken_round_by_round():
    """A slow spell that slows both arms in one round (round 2, 3x) leaves that round's ratio
    alone; the medians of each arm taken apart would mix the rounds (1.05 / 2.25 = 0.47)."""
    arm, base = [1.0, 3.0, 1.1, 1.0], [2.0, 6.0, 2.0, 2.5]
    got = paired_ratio(arm, base)
    assert got.ratios == (0.5, 0.5, 0.55, 0.4)
    assert got.median == pytest.approx(0.5)
    assert (got.min, got.max) == (0.4, 0.55)
    assert statistics.median(arm) / statistics.median(base) == pytest.approx(1.05 / 2.25)


def test_the_interval_brackets_the_median_within_the_ratios_range():
    got = paired_ratio([0.9, 1.0, 0.8, 1.2, 0.95], [1.0] * 5, confidence=0.9)
    assert got.median == pytest.approx(0.95) and got.confidence == 0.9
    assert got.min <= got.low <= got.median <= got.high <= got.max
    # the same figures give the same interval (a fixed seed), a wider confidence no narrower
    assert paired_ratio([0.9, 1.0, 0.8, 1.2, 0.95], [1.0] * 5, confidence=0.9) == got
    wide = paired_ratio([0.9, 1.0, 0.8, 1.2, 0.95], [1.0] * 5, confidence=0.99)
    assert wide.low <= got.low and wide.high >= got.high


def test_two_rounds_resample_to_either_ratio_or_their_mean():
    """Two rounds, ratios 1 and 3: a resample's median is 1, 2 or 3 (chances 1/4, 1/2, 1/4),
    so the 95 % interval runs from 1 to 3 and the 50 % interval is 2 alone."""
    assert paired_ratio([1.0, 3.0], [1.0, 1.0]).median == 2.0
    got = paired_ratio([1.0, 3.0], [1.0, 1.0])
    assert (got.low, got.high) == pytest.approx((1.0, 3.0))
    half = paired_ratio([1.0, 3.0], [1.0, 1.0], confidence=0.4)
    assert (half.low, half.high) == pytest.approx((2.0, 2.0))


def test_equal_ratios_give_a_point_and_one_round_its_own_ratio():
    same = paired_ratio([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert (same.median, same.low, same.high) == (2.0, 2.0, 2.0)
    one = paired_ratio([3.0], [4.0])
    assert (one.ratios, one.median, one.low, one.high) == ((0.75,), 0.75, 0.75, 0.75)


def test_pairs_need_one_figure_of_each():
    with pytest.raises(ValueError, match="pairs need one of each"):
        paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="no rounds"):
        paired_ratio([], [])


def test_turn_about_warms_up_then_rotates_the_order():
    calls = []

    def arm(name):
        def run():
            calls.append(name)
            return {"ttft_s": len(calls)}  # a figure the call reports: here its position

        return run

    seen = []
    done = turn_about({"a": arm("a"), "b": arm("b"), "c": arm("c")}, rounds=4, warmup=1,
                      after=lambda r, name, result: seen.append((r, name)))  # fmt: skip
    assert calls == [*"abc", *"abc", *"bca", *"cab", *"abc"]  # the warm-up, then 4 rounds
    assert done.orders == [tuple("abc"), tuple("bca"), tuple("cab"), tuple("abc")]
    assert seen[:4] == [(0, "a"), (0, "b"), (0, "c"), (1, "b")]
    # the rounds' results in round order, whatever the order within the round
    assert done.figures("a", "ttft_s") == [4, 9, 11, 13]
    assert done.figures("b", "ttft_s") == [5, 7, 12, 14]
    assert all(len(s) == 4 and min(s) >= 0 for s in done.seconds.values())
    assert done.ratio("b", "a", "ttft_s").ratios == (5 / 4, 7 / 9, 12 / 11, 14 / 13)


def test_two_arms_alternate_and_figures_come_from_attributes_or_functions():
    order = []
    results = iter([SimpleNamespace(tpot_s=t) for t in (9, 9, 2.0, 1.0, 3.0, 6.0, 1.0, 4.0)])

    def arm(name):
        return lambda: order.append(name) or next(results)

    done = turn_about({"one call": arm("one"), "in parts": arm("parts")}, rounds=3)
    assert order == ["one", "parts", "one", "parts", "parts", "one", "one", "parts"]
    assert done.figures("one call", "tpot_s") == [2.0, 6.0, 1.0]
    assert done.figures("in parts", lambda g: 1000 * g.tpot_s) == [1000.0, 3000.0, 4000.0]
    got = done.ratio("one call", "in parts", "tpot_s")
    assert got.ratios == (2.0, 2.0, 0.25) and got.median == 2.0


def test_turn_about_needs_a_round_and_an_arm():
    with pytest.raises(ValueError, match="at least one"):
        turn_about({"a": lambda: None}, rounds=0)
    with pytest.raises(ValueError, match="no arms"):
        turn_about({}, rounds=2)
