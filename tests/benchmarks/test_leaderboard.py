"""The RULER leaderboard: rows merged over runs, RULER's average, the Pareto front, tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from speedkv.evals import ruler
from speedkv.leaderboard import plot as lb_plot
from speedkv.leaderboard import published as lb_published
from speedkv.leaderboard import rows as lb_rows
from speedkv.leaderboard import tables as lb_tables

SPEED = "speed:lcut=22,anchors=bos,deep=1,selfonly=false"


def record(method: str, task: str, sample: int, score: float, **extra) -> dict:
    return {
        "method": method,
        "task": task,
        "length": 4096,
        "sample": sample,
        "prompt_tokens": 3900,
        "metric": "string_match_all",
        "score": score,
        "kv_ratio": extra.pop("kv_ratio", 1.0),
        "ttft_ratio": extra.pop("ttft_ratio", 1.0),
        "seconds": extra.pop("seconds", 2.0),
        **extra,
    }


def write_run(directory: Path, header: dict, records: list[dict]) -> Path:
    directory.mkdir(parents=True)
    lines = [json.dumps({"header": header})] + [json.dumps(r) for r in records]
    (directory / "records.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def test_rows_merge_the_parts_of_a_sweep_and_average_all_13_tasks(tmp_path: Path) -> None:
    first, second = ruler.TASKS[:7], ruler.TASKS[7:]
    a = write_run(
        tmp_path / "a",
        {"adapter": None},
        [record("full", t, i, 1.0) for t in first for i in range(2)]
        + [
            record(SPEED, t, i, 0.0, kv_ratio=0.733, ttft_ratio=0.7)
            for t in first
            for i in range(2)
        ],
    )
    b = write_run(
        tmp_path / "b",
        {"adapter": None},
        [record("full", t, i, 0.5) for t in second for i in range(2)]
        + [record(SPEED, t, 0, 1.0, kv_ratio=0.733, ttft_ratio=0.8) for t in second],
    )
    rows = {r.method: r for r in lb_rows.rows_from_runs([a, b])}
    full, speed = rows["full"], rows[SPEED]
    assert full.complete and full.min_samples == 2
    assert full.average == pytest.approx((7 * 1.0 + 6 * 0.5) / 13)  # mean of task means
    assert speed.average == pytest.approx(6 / 13)
    assert speed.min_samples == 1 and speed.kv_ratio == pytest.approx(0.733)
    assert speed.label == "SPEED-22" and speed.setting == lb_rows.AWARE


def test_a_row_missing_a_task_has_no_average(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r", {}, [record("full", t, 0, 1.0) for t in ruler.TASKS[:-1]])
    (row,) = lb_rows.rows_from_runs([run])
    assert not row.complete and row.average is None
    table = lb_tables.leaderboard_table([row], 4096)
    assert "| full attention" not in table  # not ranked on 12 tasks
    assert "Not every task measured yet: full attention." in table


def test_adapter_and_settings_are_rows_of_their_own(tmp_path: Path) -> None:
    base = write_run(tmp_path / "base", {}, [record(SPEED, t, 0, 0.0) for t in ruler.TASKS])
    trained = write_run(
        tmp_path / "trained",
        {"adapter": "adapters/smollm2-135m-speed22-bos"},
        [record(SPEED, t, 0, 1.0) for t in ruler.TASKS],
    )
    agnostic = write_run(
        tmp_path / "agnostic",
        {"setting": "agnostic"},
        [record(SPEED, t, 0, 0.5, setting="agnostic") for t in ruler.TASKS],
    )
    rows = lb_rows.rows_from_runs([base, trained, agnostic])
    assert {(r.adapter, r.setting, r.average) for r in rows} == {
        (None, lb_rows.AWARE, 0.0),
        ("adapters/smollm2-135m-speed22-bos", lb_rows.AWARE, 1.0),
        (None, lb_rows.AGNOSTIC, 0.5),
    }
    table = lb_tables.leaderboard_table(rows, 4096)
    # one line per (method, adapter): both settings of the untrained SPEED share one
    assert table.count("SPEED-22 (") == 1 and table.count("SPEED-22 + adapter") == 1
    # a task scored 0.5 may spread as far as one right and one wrong answer: the bound, on 1
    # sample a task
    assert "| 0.0 ± 0.0 | 50.0 ± 30.0 |" in table


def test_a_shared_prefill_is_question_in_view_whatever_its_record_says(tmp_path: Path) -> None:
    """Records of a shared prefill (question in view by construction) that an earlier speedkv
    labelled query-agnostic count as query-aware."""
    old = write_run(
        tmp_path / "shared",
        {"shared_prefill": True},
        [record(SPEED, t, 0, 1.0, prefill_shared=True, setting="agnostic", context_tokens=None)
         for t in ruler.TASKS],
    )  # fmt: skip
    (row,) = lb_rows.rows_from_runs([old])
    assert row.setting == lb_rows.AWARE and row.average == 1.0


def test_kvpress_settings_share_a_line(tmp_path: Path) -> None:
    records = [
        # kvpress_peer shares the context's prefill between presses: its records say so
        record(
            f"kvpress:snapkv,ratio=0.267,setting={s}", t, 0, score, setting=s, prefill_shared=True
        )
        for s, score in (("aware", 1.0), ("agnostic", 0.0))
        for t in ruler.TASKS
    ]
    run = write_run(tmp_path / "kv", {"peer": "kvpress"}, records)
    rows = lb_rows.rows_from_runs([run])
    assert {r.setting for r in rows} == {"aware", "agnostic"}
    assert {r.method for r in rows} == {"kvpress:snapkv,ratio=0.267"}
    assert {r.label for r in rows} == {"kvpress SnapKV (KV 0.733)"}
    assert lb_tables.leaderboard_table(rows, 4096).count("kvpress SnapKV") == 1
    (aware,) = [r for r in rows if r.setting == "aware"]
    assert aware.average == 1.0 and set(aware.counts.values()) == {1}


def test_a_masking_press_is_held_at_what_it_leaves_and_its_own_reference_is_not_a_row(
    tmp_path: Path,
) -> None:
    """KVzip only masks what it drops: its row's KV is the unmasked share. The kvzip sweep's own
    press=None answers are its ratios' reference; the kvpress sweep's make the no-press row."""
    none = "kvpress:none,setting=aware"
    kvzip = "kvpress:kvzip,ratio=0.267,setting=aware"
    header = {"peer": "kvpress"}
    own_none = [record(none, t, 0, 1.0, setting="aware") for t in ruler.TASKS]
    presses = write_run(tmp_path / "kvpress-1of1", header, own_none)
    masked = [record(kvzip, t, 0, 0.5, setting="aware", kv_ratio_effective=0.735)
              for t in ruler.TASKS]  # fmt: skip
    other_none = [record(none, t, 0, 0.0, setting="aware") for t in ruler.TASKS]
    zip_run = write_run(tmp_path / "kvzip-1of1", header, masked + other_none)
    rows = {r.method: r for r in lb_rows.rows_from_runs([presses, zip_run], None, [zip_run])}
    assert rows["kvpress:kvzip,ratio=0.267"].kv_ratio == 0.735
    assert rows["kvpress:none"].average == 1.0  # the kvpress sweep's answers, not kvzip's own
    # without the reference rule the later run's none answers would have replaced them
    merged = {r.method: r for r in lb_rows.rows_from_runs([presses, zip_run])}
    assert merged["kvpress:none"].average == 0.0


def test_a_quiet_bench_replaces_the_sweeps_ttft_ratio(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "r", {}, [record(SPEED, t, 0, 1.0, ttft_ratio=0.9) for t in ruler.TASKS]
    )
    bench = tmp_path / "results.json"
    bench.write_text(json.dumps({"cells": [{"method": SPEED, "length": 4096, "ttft_ratio": 0.72}]}))
    (row,) = lb_rows.rows_from_runs([run], lb_published.bench_ttft(bench))
    assert row.ttft_ratio == pytest.approx(0.72) and row.ttft_source == "bench"
    assert "0.720 |" in lb_tables.leaderboard_table([row], 4096)  # no * : a quiet measurement


def test_pareto_front() -> None:
    points = [(1.0, 0.30), (0.73, 0.04), (0.80, 0.50), (0.90, 0.50), (0.73, 0.02)]
    # (0.90, 0.50) costs more for the same score; (0.73, 0.02) scores less at the same cost
    assert lb_plot.pareto_front(points) == [1, 2]
    assert lb_plot.pareto_front([(0.5, 0.5)]) == [0]


@pytest.mark.parametrize(
    ("method", "engine", "label"),
    [
        ("full", "speedkv", "full attention"),
        (SPEED, "speedkv", "SPEED-22"),
        ("speed:lcut=22,anchors=bos,deep=64,selfonly=false", "speedkv", "SPEED-22 deep=64"),
        ("pop:lcut=22", "speedkv", "POP-22"),
        ("snapkv:retain=0.733,window=32", "speedkv", "SnapKV"),
        (
            "kvpress:expected_attention,ratio=0.267",
            "kvpress",
            "kvpress ExpectedAttention (KV 0.733)",
        ),
        ("kvpress:none", "kvpress", "kvpress no press"),
    ],
)
def test_method_labels(method: str, engine: str, label: str) -> None:
    assert lb_rows.method_label(method, engine) == label


def test_a_line_cut_short_by_a_killed_run_is_skipped(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r", {}, [record("full", t, 0, 1.0) for t in ruler.TASKS])
    with (run / "records.jsonl").open("a") as f:
        f.write('{"method": "full", "task": "ruler/vt", "len')
    header, records = lb_rows.read_run(run)
    assert len(records) == 13


def test_plot_is_written(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "r",
        {},
        [record("full", t, 0, 1.0) for t in ruler.TASKS]
        + [record(SPEED, t, 0, 0.5, kv_ratio=0.733, ttft_ratio=0.7) for t in ruler.TASKS],
    )
    path = lb_plot.plot_pareto(lb_rows.rows_from_runs([run]), 4096, tmp_path / "p.png", "test")
    assert path is not None and path.stat().st_size > 10_000
    assert lb_plot.plot_pareto([], 4096, tmp_path / "none.png") is None


def test_labels_tell_apart_the_rows_people_compare():
    assert lb_rows.method_label("speed:lcut=22,anchors=bos,deep=1") == "SPEED-22"
    assert lb_rows.method_label("speed:lcut=22,anchors=bos,deep=64") == "SPEED-22 deep=64"
    assert lb_rows.method_label("fastkv:retain=0.733") == "FastKV"
    assert lb_rows.method_label("fastkv:tsp_rate=0.733,retain=0.733") == "FastKV TSP 0.733"
    label = lb_rows.method_label
    assert label("kvpress:snapkv,ratio=0.267", "kvpress") == "kvpress SnapKV (KV 0.733)"
    assert label("kvpress:snapkv,ratio=0.133", "kvpress") == "kvpress SnapKV (KV 0.867)"


def test_the_front_joins_untrained_rows_and_ties_at_one_budget(tmp_path: Path) -> None:
    def row(method, score, kv, adapter=None):
        run = write_run(
            tmp_path / f"{method}-{adapter}".replace(":", "_").replace("/", "_"),
            {"adapter": adapter},
            [record(method, t, 0, score, kv_ratio=kv) for t in ruler.TASKS],
        )
        return lb_rows.rows_from_runs([run])[0]

    rows = [
        row("full", 0.35, 1.0),
        row("snapkv:retain=0.733", 0.28, 0.7331),
        row("h2o:heavy=0.3665,recent=0.3665", 0.22, 0.7329),  # cheaper only by rounding
        row(SPEED, 0.35, 0.733, adapter="adapters/x"),  # trained: not on the front
        row("fastkv:retain=0.733", 0.16, 0.466),
    ]
    front = [rows[i].method for i in lb_plot.untrained_front(rows, "kv_ratio")]
    assert front == ["fastkv:retain=0.733", "snapkv:retain=0.733", "full"]


def test_published_rows_read_back_as_they_were_written(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "r",
        {"adapter": "adapters/a"},
        [record(SPEED, t, 0, 0.5, kv_ratio=0.733, ttft_ratio=0.7) for t in ruler.TASKS],
    )
    rows = lb_rows.rows_from_runs([run])
    back = lb_published.rows_from_json(json.loads(json.dumps(lb_published.to_json(rows))))
    assert back == rows
    assert back[0].average == pytest.approx(0.5)


def test_a_published_row_is_kept_until_a_run_of_its_own_replaces_it(tmp_path: Path) -> None:
    """A sweep finished on another machine keeps its published figures; a row measured here
    replaces the published one of the same method, adapter, setting and length."""
    full = write_run(tmp_path / "full", {}, [record("full", t, 0, 1.0) for t in ruler.TASKS])
    published = lb_published.rows_from_json(
        lb_published.to_json(
            lb_rows.rows_from_runs(
                [
                    write_run(
                        tmp_path / "old",
                        {},
                        [record(m, t, 0, 0.25) for m in ("full", SPEED) for t in ruler.TASKS],
                    )
                ]
            )
        )
    )
    rows, carried = lb_published.with_published(lb_rows.rows_from_runs([full]), published)
    by_method = {r.method: r for r in rows}
    assert [r.method for r in carried] == [SPEED]
    assert by_method["full"].average == pytest.approx(1.0)  # measured here
    assert by_method[SPEED].average == pytest.approx(0.25)  # as published
    assert len(rows) == 2


def test_answers_are_counted_by_the_machine_that_made_them(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "r",
        {},
        [record("full", "ruler/vt", i, 1.0, machine="cpu A") for i in range(3)]
        + [
            record("full", "ruler/vt", 3, 1.0, machine="cpu B", seconds=5.0),
            record("full", "ruler/vt", 4, 1.0),
        ],
    )
    # answers and their summed wall time per CPU, most answers first
    assert lb_rows.answers_by_machine([run]) == {
        "cpu A": (3, 6.0),
        "cpu B": (1, 5.0),
        "not recorded": (1, 2.0),
    }


def test_a_rows_margin_is_the_95_percent_interval_of_its_task_means(tmp_path: Path) -> None:
    # every task: 10 samples, half right; the average is 0.5 and each task mean's variance
    # 0.25 / 10, so the average's is 0.025 / 13
    records = [record("full", t, i, float(i % 2)) for t in ruler.TASKS for i in range(10)]
    (row,) = lb_rows.rows_from_runs([write_run(tmp_path / "r", {}, records)])
    assert row.average == pytest.approx(0.5)
    assert row.margin == pytest.approx(1.96 * (0.025 / 13) ** 0.5)
    assert "| 50.0 ± 8.6 |" in lb_tables.leaderboard_table([row], 4096)
    partial = [r for r in records if r["task"] != ruler.TASKS[0]]
    (unranked,) = lb_rows.rows_from_runs([write_run(tmp_path / "p", {}, partial)])
    assert unranked.margin is None


def test_few_samples_a_task_widen_the_margin_to_students_t(tmp_path: Path) -> None:
    # 4 samples a task, half right: each task mean's variance is 0.25 / 4, all alike, so the
    # Welch-Satterthwaite degrees of freedom are 13 * 3 = 39 and t(0.975, 39) = 2.0227
    records = [record("full", t, i, float(i % 2)) for t in ruler.TASKS for i in range(4)]
    (row,) = lb_rows.rows_from_runs([write_run(tmp_path / "r", {}, records)])
    assert row.margin == pytest.approx(2.0227 * (13 * 0.0625) ** 0.5 / 13, rel=1e-4)
    assert lb_rows.critical_value([(0.1, 10), (0.2, 30)]) == 1.96
    assert lb_rows.critical_value([(0.0, 3), (0.0, 3)]) == 1.96  # no spread: nothing to widen
    # one task of 2 samples dominating the spread: close to t with 1 degree of freedom
    assert lb_rows.critical_value([(1.0, 2), (1e-6, 40)]) == pytest.approx(12.706, rel=1e-3)


def test_speed_meets_each_press_at_its_kv_ratio_with_the_margins(tmp_path: Path) -> None:
    def run(name: str, header: dict, method: str, right: int, kv: float, **extra) -> Path:
        records = [
            record(method, t, i, float(i < right), kv_ratio=kv, **extra)
            for t in ruler.TASKS
            for i in range(20)
        ]
        return write_run(tmp_path / name, header, records)

    kvpress = {"engine": "kvpress"}
    rows = lb_rows.rows_from_runs(
        [
            run("full", {}, "full", 10, 1.0),
            run("speed", {}, SPEED, 10, 0.733),
            run("snap", kvpress, "kvpress:snapkv,ratio=0.267,setting=aware", 2, 0.735),
            run("tova", kvpress, "kvpress:tova,ratio=0.267,setting=aware", 9, 0.735),
            run("far", kvpress, "kvpress:knorm,ratio=0.133,setting=aware", 0, 0.868),
            run("none", kvpress, "kvpress:none,setting=aware", 10, 1.0),
        ]
    )
    table = lb_tables.equal_kv_table(rows, 4096)
    lines = [line for line in table.splitlines() if line.startswith("| query-aware")]
    # only the presses at SPEED-22's ratio; the best first
    assert [line.split(" | ")[4] for line in lines] == [
        "kvpress TOVA (KV 0.733)",
        "kvpress SnapKV (KV 0.733)",
    ]
    # paired on the same samples: SPEED answers sample 9 of each task, TOVA does not, and
    # they agree on the other 19: 5 points apart, told apart
    assert lines[0].endswith("| 50.0 ± 6.1 | kvpress TOVA (KV 0.733) | 45.0 ± 6.0 "
                             "| +5.0 ± 2.7 | SPEED ahead (paired) |")  # fmt: skip
    assert lines[1].endswith("| 10.0 ± 3.6 | +40.0 ± 6.1 | SPEED ahead (paired) |")
    assert "speedkv query-aware 50.0 ± 6.1; kvpress query-aware 50.0 ± 6.1" in table
    # a published row keeps no samples: the two margins combined, and 5 points is within them
    speed = [r for r in rows if r.method == SPEED]
    published = lb_published.rows_from_json(lb_published.to_json(speed))
    presses = [r for r in rows if r.engine == "kvpress"]
    unpaired = lb_tables.equal_kv_table(published + presses, 4096)
    assert "| +5.0 ± 8.6 | within the margins |" in unpaired
    assert "| +40.0 ± 7.1 | SPEED ahead |" in unpaired
    assert lb_tables.equal_kv_table(speed, 4096) == ""  # no press to meet


def test_a_difference_is_paired_only_with_two_shared_samples_in_every_task(tmp_path: Path) -> None:
    def row(name: str, method: str, samples: int) -> lb_rows.Row:
        records = [record(method, t, i, float(i % 2)) for t in ruler.TASKS for i in range(samples)]
        (made,) = lb_rows.rows_from_runs([write_run(tmp_path / name, {}, records)])
        return made

    one, other = row("a", "full", 1), row("b", SPEED, 1)
    assert lb_tables.difference(one, other) == (0.0, 0.0, False)  # one sample a task: unpaired
    gap, margin, paired = lb_tables.difference(row("c", "full", 4), row("d", SPEED, 4))
    assert paired and gap == 0.0 and margin == 0.0  # the same answers: no doubt about it


def test_a_press_meets_its_own_reference_on_the_same_samples(tmp_path: Path) -> None:
    """The kvzip sweep's own no-press answers: the press's paired difference against them, the
    answers that match word for word, and its TTFT ratio told per CPU."""
    none = "kvpress:none,setting=aware"
    kvzip = "kvpress:kvzip,ratio=0.267,setting=aware"
    common = {"setting": "aware"}
    reference, pressed = [], []
    for t in ruler.TASKS:
        for s in range(2):
            machine = "cpu A" if s == 0 else "cpu B"
            reference.append(record(none, t, s, 1.0, answer="x", machine=machine, **common))
            wrong = t == ruler.TASKS[0] and s == 1  # one answer of 26 differs, and scores 0
            pressed.append(record(kvzip, t, s, 0.0 if wrong else 1.0, answer="y" if wrong else "x",
                                  ttft_ratio=10.0 + s, machine=machine, kv_ratio_effective=0.735,
                                  **common))  # fmt: skip
    run = write_run(tmp_path / "kvzip-1of1", {"peer": "kvpress"}, reference + pressed)
    table = lb_tables.own_reference_table([run])
    (line,) = [row for row in table.splitlines() if "KVzip" in row]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[0] == "query-aware" and cells[2] == "0.735"
    gap = -100 * 0.5 / len(ruler.TASKS)  # one task's mean falls by half
    assert cells[5].startswith(f"{gap:+.1f} ± ") and "unpaired" not in cells[5]
    assert cells[6] == f"25 of {2 * len(ruler.TASKS)}"
    assert cells[7] == f"10.0 on cpu A ({len(ruler.TASKS)}); 11.0 on cpu B ({len(ruler.TASKS)})"
    assert lb_tables.own_reference_table([]) == ""
