"""Turn-about A/B timing: two (or more) arms run in turn, round after round, and compared by
the ratio within each round.

Why turn about: on a shared CPU the speed of the same work drifts by tens of percent, up to
1.5-2x, within minutes. Timing all of A and then all of B measures the drift as much as the
difference. Run in turn, A and B of one round meet the same machine, so a slow spell slows both
alike and leaves their ratio alone; the median of the rounds' ratios then sheds the rest. The
order rotates from round to round, so no arm always runs first (after a pause, or after the
other arm has warmed a cache).

    result = turn_about({"native": run_native, "int8": run_int8}, rounds=6)
    result.ratio("int8", "native").median           # wall seconds of each call
    result.ratio("int8", "native", "tpot_s")        # or a figure the calls return

`paired_ratio` does the arithmetic alone, for pairs taken elsewhere (rows read from a file).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")
# what a figure is read from an arm's result by: None (the call's wall seconds), a key of the
# result (a mapping's item or an attribute), or a function of the result
Metric = None | str | Callable[[Any], float]


@dataclass(frozen=True)
class PairedRatio:
    """The ratios of one arm's figures over another's, round by round, and what they say."""

    ratios: tuple[float, ...]  # arm / base, one per round, in round order
    median: float
    low: float  # the bootstrap interval on the median, at `confidence`
    high: float
    confidence: float

    @property
    def min(self) -> float:
        return min(self.ratios)

    @property
    def max(self) -> float:
        return max(self.ratios)


def paired_ratio(arm: Sequence[float], base: Sequence[float], confidence: float = 0.95,
                 resamples: int = 10_000, seed: int = 0) -> PairedRatio:  # fmt: skip
    """The median of `arm[i] / base[i]` over the rounds i, with a percentile bootstrap
    interval on that median (the rounds resampled with replacement `resamples` times, from a
    fixed seed, so the same figures give the same interval). Few rounds give a wide interval,
    as they should; one round gives that round's ratio as both ends."""
    if len(arm) != len(base):
        raise ValueError(f"{len(arm)} figures against {len(base)}: pairs need one of each")
    if not arm:
        raise ValueError("no rounds to compare")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence {confidence} is not between 0 and 1")
    ratios = tuple(a / b for a, b in zip(arm, base))
    low, high = bootstrap_median_interval(ratios, confidence, resamples, seed)
    return PairedRatio(ratios, statistics.median(ratios), low, high, confidence)


def bootstrap_median_interval(values: Sequence[float], confidence: float, resamples: int,
                              seed: int) -> tuple[float, float]:  # fmt: skip
    """The percentile bootstrap interval on the median of `values`."""
    import numpy as np

    data = np.asarray(values, dtype=np.float64)
    picks = np.random.default_rng(seed).integers(0, len(data), size=(resamples, len(data)))
    medians = np.median(data[picks], axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(medians, [tail, 1 - tail])
    return float(low), float(high)


@dataclass
class TurnAbout(Generic[T]):
    """What `turn_about` measured: per arm, each timed round's result and wall seconds."""

    arms: tuple[str, ...]
    orders: list[tuple[str, ...]] = field(default_factory=list)  # each timed round's order
    results: dict[str, list[T]] = field(default_factory=dict)
    seconds: dict[str, list[float]] = field(default_factory=dict)

    def figures(self, arm: str, metric: Metric = None) -> list[float]:
        """`arm`'s figure in each round: its wall seconds, or `metric` of its result."""
        if metric is None:
            return list(self.seconds[arm])
        return [figure(r, metric) for r in self.results[arm]]

    def ratio(self, arm: str, base: str, metric: Metric = None,
              confidence: float = 0.95) -> PairedRatio:  # fmt: skip
        """`arm` over `base`, round by round (see `paired_ratio`)."""
        return paired_ratio(self.figures(arm, metric), self.figures(base, metric), confidence)


def figure(result: Any, metric: str | Callable[[Any], float]) -> float:
    if callable(metric):
        return float(metric(result))
    if isinstance(result, Mapping):
        return float(result[metric])
    return float(getattr(result, metric))


def turn_about(arms: Mapping[str, Callable[[], T]], rounds: int, warmup: int = 1,
               after: Callable[[int, str, T], None] | None = None) -> TurnAbout[T]:  # fmt: skip
    """Call every arm once per round for `warmup` untimed rounds, then `rounds` timed ones, the
    order rotated by one arm each round (A B, B A, ...; A B C, B C A, C A B, ...). Each arm is a
    callable of no arguments; what it returns is kept, with its wall seconds. `after(round,
    arm, result)` is called after each timed call (to log or save progress)."""
    if rounds < 1:
        raise ValueError(f"{rounds} rounds: at least one is needed")
    names = tuple(arms)
    if not names:
        raise ValueError("no arms to compare")
    done: TurnAbout[T] = TurnAbout(names, results={n: [] for n in names},
                                   seconds={n: [] for n in names})  # fmt: skip
    for _ in range(warmup):
        for name in names:
            arms[name]()
    for round_ in range(rounds):
        shift = round_ % len(names)
        order = names[shift:] + names[:shift]
        done.orders.append(order)
        for name in order:
            start = time.perf_counter()
            result = arms[name]()
            done.seconds[name].append(time.perf_counter() - start)
            done.results[name].append(result)
            if after is not None:
                after(round_, name, result)
    return done
