"""A board's published figures (results.json): written beside its tables, read back where the
runs behind a row are not here, so a re-render keeps what was published for them."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from speedkv.leaderboard.rows import Row, _row_order


def bench_ttft(path: Path) -> dict[tuple[str, int], float]:
    """TTFT ratios against full from a `speedkv bench` results.json: (method, length) -> x."""
    data = json.loads(Path(path).read_text())
    return {(c["method"], int(c["length"])): float(c["ttft_ratio"]) for c in data["cells"]}


def published_bench_ttft(published: Iterable[Row]) -> dict[tuple[str, int], float]:
    """The quiet-bench TTFT ratios a published board's rows carry, as `bench_ttft` gives them:
    what a board rendered where its `ttft` sweep's results are not keeps for speedkv's rows."""
    return {
        (r.method, r.length): r.ttft_ratio
        for r in published
        if r.engine == "speedkv" and r.ttft_source == "bench" and r.ttft_ratio is not None
    }


def rows_from_json(items: list[dict]) -> list[Row]:
    """Rows from a leaderboard's results.json (`to_json`): its figures as published."""
    names = [f.name for f in Row.__dataclass_fields__.values() if f.name != "extra"]
    return [Row(**{name: item[name] for name in names if name in item}) for item in items]


def row_identity(row: Row) -> tuple:
    """One row of one setting at one length: the unit a newer run replaces."""
    return (row.engine, row.adapter, row.setting, row.method, row.length)


def with_published(rows: list[Row], published: list[Row]) -> tuple[list[Row], list[Row]]:
    """`rows` and each published row that none of them replaces (its runs are elsewhere: the
    records of a sweep finished on another machine), and the published rows so carried."""
    fresh = {row_identity(r) for r in rows}
    carried = [r for r in published if row_identity(r) not in fresh]
    return sorted(rows + carried, key=_row_order), carried


def to_json(rows: list[Row]) -> list[dict]:
    return [
        {
            "method": r.method,
            "label": r.label,
            "engine": r.engine,
            "adapter": r.adapter,
            "setting": r.setting,
            "length": r.length,
            "average": r.average,
            "scores": r.scores,
            "counts": r.counts,
            "kv_ratio": r.kv_ratio,
            "ttft_ratio": r.ttft_ratio,
            "ttft_source": r.ttft_source,
            "seconds": r.seconds,
        }
        for r in rows
    ]
