"""The RULER leaderboard's plans: every row a valid spec, peers at SPEED's KV ratio, the shipped
adapters present, and the commands each sweep would run."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from speedkv.core.registry import parse_spec
from speedkv.errors import UserError
from speedkv.evals import ruler
from speedkv.leaderboard import archives as lb_archives
from speedkv.leaderboard import lanes as lb_lanes
from speedkv.leaderboard import plans as lb_plans
from speedkv.leaderboard import published as lb_published
from speedkv.leaderboard import render as lb_render
from speedkv.leaderboard import rows as lb_rows
from speedkv.leaderboard.run import Options, run

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("key", list(lb_plans.PLANS), ids=lambda k: f"{k[0]}-{k[1]}")
def test_every_plan_names_valid_rows_and_a_shipped_adapter(key):
    plan = lb_plans.PLANS[key]
    sweeps = lb_plans.sweeps(plan)
    for sweep in sweeps.values():
        if not sweep.peer:
            for method in sweep.methods:
                parse_spec(method)  # raises on a bad spec
    assert (ROOT / plan.adapter / "adapter_model.safetensors").is_file()
    assert 0 < plan.kv < 1 and plan.samples >= 1
    # SPEED's rows spell their deep suffix: the leaderboard must not move with the default
    assert all("deep=" in spec for spec in plan.speed)
    assert ("agnostic" in sweeps) == bool(plan.agnostic)


@pytest.mark.parametrize("key", list(lb_plans.PLANS), ids=lambda k: f"{k[0]}-{k[1]}")
def test_every_plan_leaves_room_for_rulers_longest_answer(key):
    """RULER fits its text to the length (fwe all of it, answer aside), so a plan's length and
    RULER's longest answer must fit the model's context with room for the chat template, or the
    plan's sweeps stop at their samples' check (SmolLM2's 8K plan: 8192 - 128)."""
    from speedkv.evals import ruler
    from speedkv.hf.loading import EMBEDDED, model_directory

    name, length = key
    if EMBEDDED[name].part_paths() is None:
        pytest.skip(f"{name} is not installed")
    config = json.loads((model_directory(name, progress=False) / "config.json").read_text())
    assert length + ruler.longest_answer() <= config["max_position_embeddings"]


def test_the_4k_board_runs_every_method_at_speed22s_kv_ratio(tmp_path):
    plan = lb_plans.PLANS[("smollm2-135m", 4096)]
    names = {parse_spec(m).name for m in lb_plans.sweeps(plan)["base"].methods}
    assert names == {
        "full", "speed", "snapkv", "streamingllm", "pop", "swiftkv", "fastkv", "specprefill",
        "gemfilter", "h2o", "pyramidinfer",
    }  # fmt: skip
    assert f"retain={plan.kv}" in lb_plans.sweeps(plan)["base"].methods[4]
    command = lb_lanes.eval_command(
        "smollm2-135m", 4096, plan.samples, lb_plans.sweeps(plan)["adapter"], ["ruler/vt"], tmp_path
    )
    assert command[command.index("--samples") + 1] == "ruler=20"
    assert command[-2:] == ["--adapter", plan.adapter]
    # the board's dtype on every CPU (auto would be float32 on one without bf16 instructions)
    assert command[command.index("--dtype") + 1] == "bfloat16" == lb_plans.DTYPE


def test_kvpress_runs_at_every_kv_ratio_speed_reaches():
    smollm2 = lb_plans.PLANS[("smollm2-135m", 4096)]
    assert smollm2.compression_ratios() == "0.267,0.133"  # SPEED-22 and SPEED-26
    assert lb_plans.PLANS[("qwen2.5-coder-0.5b", 4096)].compression_ratios() == "0.250"


def test_docs_refresh_replaces_only_the_fenced_tables():
    begin, end = lb_render.docs_markers("m-4096")
    page = f"# Title\n\nprose before\n\n{begin}\n\n| old |\n\n{end}\n\nprose after\n"
    fresh = lb_render.refresh_docs(page, "m-4096", "| new |\n")
    assert fresh == f"# Title\n\nprose before\n\n{begin}\n\n| new |\n\n{end}\n\nprose after\n"
    assert lb_render.refresh_docs(fresh, "m-4096", "| new |") == fresh  # idempotent
    with pytest.raises(SystemExit, match="no single fenced region for m-8192"):
        lb_render.refresh_docs(page, "m-8192", "| new |")


def test_the_published_page_is_fenced_for_the_4k_board():
    page = (ROOT / "docs" / "ruler.md").read_text()
    begin, end = lb_render.docs_markers("smollm2-135m-4096")
    assert page.count(begin) == page.count(end) == 1


def test_later_plans_share_one_prefill_and_the_4k_board_keeps_its_own():
    for key, plan in lb_plans.PLANS.items():
        sweeps = lb_plans.sweeps(plan)
        for name in ("base", "adapter"):
            shared = "--shared-prefill" in sweeps[name].args
            assert shared is (key != ("smollm2-135m", 4096)), (key, name)
        if "agnostic" in sweeps:  # a context cached before its question is each method's own
            assert "--shared-prefill" not in sweeps["agnostic"].args


def kvpress_board(work: Path, scores: dict[str, float], samples: int = 20) -> None:
    """A finished (or not) SmolLM2 4K kvpress sweep under `work`: every press at both ratios
    and settings, each task at `samples` samples scoring scores[press]."""
    records = []
    for press, score in scores.items():
        for ratio in (0.267, 0.133):
            for setting in ("aware", "agnostic"):
                for task in ruler.TASKS:
                    for sample in range(samples):
                        records.append({
                            "method": f"kvpress:{press},ratio={ratio:g},setting={setting}",
                            "task": task, "length": 4096, "sample": sample,
                            "prompt_tokens": 3900, "metric": "string_match_all",
                            "score": score if ratio == 0.267 else 1 - score,
                            "kv_ratio": 1 - ratio, "ttft_ratio": 1.0, "setting": setting,
                        })  # fmt: skip
    run = work / "smollm2-135m" / "4096" / "kvpress-1of1"
    run.mkdir(parents=True)
    lines = [json.dumps({"header": {"peer": "kvpress"}})] + [json.dumps(r) for r in records]
    (run / "records.jsonl").write_text("\n".join(lines) + "\n")


def test_later_plans_take_the_4k_boards_best_presses_at_speed22s_kv(tmp_path):
    presses = lb_plans.split_commas(lb_plans.PLANS[("smollm2-135m", 4096)].presses)
    scores = dict(zip(presses, (0.1, 0.5, 0.3, 0.4, 0.2)))  # at 0.867 KV the order reverses
    kvpress_board(tmp_path, scores)
    # KVzip, a sweep of its own, published part-way and scoring higher, is not among them
    kvpress_board(tmp_path / "kvzip", {"kvzip": 0.9}, samples=8)
    kvzip = lb_rows.rows_from_runs([tmp_path / "kvzip" / "smollm2-135m" / "4096" / "kvpress-1of1"])
    published = tmp_path / "results.json"
    published.write_text(json.dumps(lb_published.to_json(kvzip)))
    assert lb_plans.best_presses(tmp_path, 2, published) == f"{presses[1]},{presses[3]}"
    assert lb_plans.best_presses(tmp_path, 1, published) == presses[1]
    assert lb_plans.PLANS[lb_plans.SMOLLM2_8K].presses == "best:2"


def test_best_presses_wait_for_the_whole_4k_sweep(tmp_path):
    presses = lb_plans.split_commas(lb_plans.PLANS[("smollm2-135m", 4096)].presses)
    kvpress_board(tmp_path, dict.fromkeys(presses, 0.5), samples=19)
    with pytest.raises(SystemExit, match="kvpress sweep is not complete"):
        lb_plans.best_presses(tmp_path, 2)
    kvpress_board(tmp_path / "other", dict.fromkeys(presses[:-1], 0.5))  # a press missing
    with pytest.raises(SystemExit, match="kvpress sweep is not complete"):
        lb_plans.best_presses(tmp_path / "other", 2, published=tmp_path / "none.json")


def test_best_presses_come_from_the_published_board_where_its_runs_are_elsewhere(tmp_path):
    presses = lb_plans.split_commas(lb_plans.PLANS[("smollm2-135m", 4096)].presses)
    scores = dict(zip(presses, (0.1, 0.5, 0.3, 0.4, 0.2)))
    kvpress_board(tmp_path / "elsewhere", scores)
    rows = lb_rows.rows_from_runs(
        [tmp_path / "elsewhere" / "smollm2-135m" / "4096" / "kvpress-1of1"]
    )
    published = tmp_path / "results.json"
    published.write_text(json.dumps(lb_published.to_json(rows)))
    assert lb_plans.best_presses(tmp_path / "here", 2, published) == f"{presses[1]},{presses[3]}"
    # a press missing from what was published is still refused
    published.write_text(
        json.dumps(lb_published.to_json([r for r in rows if presses[0] not in r.method]))
    )
    with pytest.raises(SystemExit, match="kvpress sweep is not complete"):
        lb_plans.best_presses(tmp_path / "here", 2, published)


def test_kvpress_runs_in_the_settings_speedkvs_rows_have(tmp_path):
    class Args:
        kvpress_python, model, length, samples = "py", "m", 4096, 2
        board = tmp_path / "board"

    for key, plan in lb_plans.PLANS.items():
        sweep = lb_plans.sweeps(plan)["kvpress"]
        part = tmp_path / "kvpress-1of2"
        command = lb_lanes.kvpress_command(Args, plan, sweep, ["ruler/vt"], part)
        settings = command[command.index("--settings") + 1]
        assert settings == ("aware,agnostic" if plan.agnostic else "aware"), key
        assert "--attention" not in command  # no peer answers yet: the first part decides
    assert lb_plans.PLANS[("smollm2-135m", 4096)].kvpress_settings() == "aware,agnostic"


def test_every_peer_part_of_a_board_computes_attention_as_its_first_did(tmp_path, monkeypatch):
    """KVzip's part (and its full-attention answers, merged with the other parts') follows
    the attention of the board's kvpress answers, whichever this machine would choose."""

    class Args:
        kvpress_python, model, length, samples = "py", "m", 4096, 2
        board = tmp_path / "board"
        jobs, lanes = 2, []

    plan = lb_plans.PLANS[("smollm2-135m", 4096)]
    kvzip = lb_plans.sweeps(plan)["kvzip"]
    work = tmp_path / "work"
    # only archived answers, as where a sweep goes on on another machine: the sweeps restore
    # them before any part's command is made
    archived = Args.board / "answers" / "kvpress-1of2.kvpress-results.jsonl.gz"
    archived.parent.mkdir(parents=True)
    archived.write_bytes(gzip.compress(b'{"header": {"attention": "float32"}}\n{"job": "a"}\n'))
    commands = []

    def lane(args, plan, sweeps, work, part):
        commands.append(
            lb_lanes.kvpress_command(args, plan, sweeps[0], ["ruler/vt"], work / "kvzip-1of2")
        )

    monkeypatch.setattr(lb_lanes, "run_lane", lane)
    lb_lanes.run_sweeps(Args, plan, [kvzip], work)
    assert [c[c.index("--attention") + 1] for c in commands] == ["float32", "float32"]
    # what is here decides (the restored part, rewritten)
    part = work / "kvpress-1of2"
    results = part / "kvpress-results.jsonl"
    # bfloat16 where a header does not say (answers from before headers said)
    for header in [{"peer": "kvpress"}, {"peer": "kvpress", "attention": "bfloat16"}]:
        results.write_text(json.dumps({"header": header}) + "\n")
        command = lb_lanes.kvpress_command(Args, plan, kvzip, ["ruler/vt"], work / "kvzip-1of2")
        assert command[command.index("--attention") + 1] == "bfloat16"


def test_kvzip_runs_on_its_own_sample_count_unless_one_is_asked_for(tmp_path):
    """Qwen2.5's 4K plan checks KVzip on 5 samples a task and SmolLM2's 8K plan on 3 (its
    replays cost about five prefills); the plans' other sweeps keep theirs, and --samples sets
    every sweep's."""

    class Args:
        kvpress_python, model, length, samples = "py", "qwen2.5-coder-0.5b", 4096, 10
        board = tmp_path / "board"

    def samples(plan, sweep: str) -> str:
        command = lb_lanes.kvpress_command(
            Args, plan, lb_plans.sweeps(plan)[sweep], ["ruler/vt"], tmp_path / f"{sweep}-1of2"
        )
        return command[command.index("--samples") + 1]

    qwen_4k = lb_plans.PLANS[("qwen2.5-coder-0.5b", 4096)]
    assert (samples(qwen_4k, "kvzip"), samples(qwen_4k, "kvpress")) == ("5", "10")
    assert "kvzip" not in lb_plans.sweeps(lb_plans.PLANS[("qwen2.5-coder-0.5b", 16384)])
    assert samples(lb_plans.PLANS[lb_plans.SMOLLM2_8K], "kvzip") == "3"  # beside best:2's 10
    assert samples(lb_plans.PLANS[("smollm2-135m", 4096)], "kvzip") == "10"  # args.samples


def test_archived_answers_seed_a_sweep_on_another_machine(tmp_path):
    """--archive keeps each part's resume file (kvpress's raw answers, speedkv eval's records)
    beside the board, byte for byte and the same bytes each time; a part with nothing yet
    starts from it, a part with answers of its own keeps them."""
    work, board_dir = tmp_path / "work", tmp_path / "board"
    kvpress, base = work / "kvpress-1of2", work / "base-2of2"
    kvpress.mkdir(parents=True)
    base.mkdir()
    (kvpress / "kvpress-results.jsonl").write_text('{"header": {}}\n{"job": "a"}\n')
    (kvpress / "records.jsonl").write_text("rebuilt from the raw answers at the end\n")
    (base / "records.jsonl").write_text('{"header": {}}\n{"task": "ruler/vt"}\n')
    written = lb_archives.archive_answers(work, board_dir)
    assert [p.name for p in written] == [
        "base-2of2.records.jsonl.gz",
        "kvpress-1of2.kvpress-results.jsonl.gz",
        "kvpress-1of2.records.jsonl.gz",  # up to date with the raw answers: a render reads them
    ]
    first = [p.read_bytes() for p in written]
    assert lb_archives.archive_answers(work, board_dir) == []  # nothing new: the archive is kept
    assert [p.read_bytes() for p in written] == first
    # an archive that grew elsewhere is not replaced by an older copy restored here
    grown = b'{"header": {}}\n{"job": "a"}\n{"job": "b"}\n'
    written[1].write_bytes(gzip.compress(grown))
    assert lb_archives.archive_answers(work, board_dir) == []
    assert gzip.decompress(written[1].read_bytes()) == grown
    written[1].write_bytes(first[1])

    elsewhere = tmp_path / "elsewhere"
    for part in ("kvpress-1of2", "base-2of2"):
        assert lb_archives.restore_answers(board_dir, elsewhere / part)
    assert (elsewhere / "kvpress-1of2" / "kvpress-results.jsonl").read_text() == (
        kvpress / "kvpress-results.jsonl"
    ).read_text()
    restored = elsewhere / "kvpress-1of2"
    assert (restored / "records.jsonl").read_text() == (kvpress / "records.jsonl").read_text()
    # written after the answers: a render takes them as they are, without kvpress's environment
    assert (restored / "records.jsonl").stat().st_mtime >= (
        restored / "kvpress-results.jsonl"
    ).stat().st_mtime
    assert (elsewhere / "base-2of2" / "records.jsonl").read_text() == (
        base / "records.jsonl"
    ).read_text()
    (elsewhere / "base-2of2" / "records.jsonl").write_text("newer\n")
    assert not lb_archives.restore_answers(board_dir, elsewhere / "base-2of2")
    assert (elsewhere / "base-2of2" / "records.jsonl").read_text() == "newer\n"
    assert not lb_archives.restore_answers(board_dir, elsewhere / "kvzip-1of2")  # none archived


def test_archived_peer_records_follow_the_archived_answers(tmp_path):
    """A kvpress part's records are archived only while they describe the archived answers:
    answers archived without fresh records drop the old archived copy."""
    work, board_dir = tmp_path / "work", tmp_path / "board"
    part = work / "kvzip-1of2"
    part.mkdir(parents=True)
    (part / "kvpress-results.jsonl").write_text('{"header": {}}\n{"job": "a"}\n')
    (part / "records.jsonl").write_text("records of job a\n")
    lb_archives.archive_answers(work, board_dir)
    records = board_dir / "answers" / "kvzip-1of2.records.jsonl.gz"
    assert gzip.decompress(records.read_bytes()) == b"records of job a\n"
    # more answers, and records not yet rewritten from them (a sweep writes them when it stops)
    raw = part / "kvpress-results.jsonl"
    raw.write_text('{"header": {}}\n{"job": "a"}\n{"job": "b"}\n')
    os.utime(part / "records.jsonl", (1, 1))
    assert [p.name for p in lb_archives.archive_answers(work, board_dir)] == [
        "kvzip-1of2.kvpress-results.jsonl.gz"
    ]
    assert not records.exists()
    (part / "records.jsonl").write_text("records of jobs a and b\n")
    assert lb_archives.archive_answers(work, board_dir) == [records]


def test_render_keeps_published_rows_whose_runs_are_elsewhere(tmp_path):
    """A board rendered where only some sweeps ran keeps the others' published rows."""

    def run(directory: Path, method: str, score: float) -> Path:
        directory.mkdir(parents=True)
        records = [
            {"method": method, "task": t, "length": 4096, "sample": 0, "prompt_tokens": 3900,
             "metric": "string_match_all", "score": score, "kv_ratio": 1.0, "ttft_ratio": 1.0}
            for t in ruler.TASKS
        ]  # fmt: skip
        lines = [json.dumps({"header": {}})] + [json.dumps(r) for r in records]
        (directory / "records.jsonl").write_text("\n".join(lines) + "\n")
        return directory

    out = tmp_path / "board"
    out.mkdir()
    published = lb_rows.rows_from_runs([run(tmp_path / "old" / "base-1of1", "pop:lcut=22", 0.25)])
    (out / "results.json").write_text(json.dumps(lb_published.to_json(published)))
    work = tmp_path / "work"
    run(work / "base-1of1", "full", 1.0)

    class Args:
        model, length, docs = "smollm2-135m", 4096, None

    lb_render.render(Args, lb_plans.PLANS[("smollm2-135m", 4096)], work, out)
    rows = {r["method"]: r for r in json.loads((out / "results.json").read_text())}
    assert rows["full"]["average"] == pytest.approx(1.0)
    assert rows["pop:lcut=22"]["average"] == pytest.approx(0.25)
    page = (out / "leaderboard.md").read_text()
    assert "and 1 rows as published before" in page
    # answers are counted per sweep (the parts' folder names without -NofM) and CPU
    assert "by sweep and the CPU that made them" in page
    assert "- `base`: not recorded: 13 in 0.0 h" in page


def test_a_board_rendered_without_its_ttft_run_keeps_the_published_bench_ratios(tmp_path):
    """Runs resumed on another machine replace their published rows; the quiet bench's TTFT
    ratios, which that machine did not measure, come from the published rows."""

    def run(directory: Path, method: str) -> Path:
        directory.mkdir(parents=True)
        records = [
            {"method": method, "task": t, "length": 4096, "sample": 0, "prompt_tokens": 3900,
             "metric": "string_match_all", "score": 1.0, "kv_ratio": 0.733, "ttft_ratio": 0.9}
            for t in ruler.TASKS
        ]  # fmt: skip
        lines = [json.dumps({"header": {}})] + [json.dumps(r) for r in records]
        (directory / "records.jsonl").write_text("\n".join(lines) + "\n")
        return directory

    speed = "speed:lcut=22,anchors=bos,deep=1"
    published = lb_rows.rows_from_runs([run(tmp_path / "old" / "base-1of1", speed)],
                                  ttft={(speed, 4096): 0.722})  # fmt: skip
    out = tmp_path / "board"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(lb_published.to_json(published)))
    work = tmp_path / "work"
    run(work / "base-1of1", speed)  # no work/ttft here

    class Args:
        model, length, docs = "smollm2-135m", 4096, None

    lb_render.render(Args, lb_plans.PLANS[("smollm2-135m", 4096)], work, out)
    (row,) = json.loads((out / "results.json").read_text())
    assert (row["ttft_ratio"], row["ttft_source"]) == (0.722, "bench")  # not the records' 0.9
    assert "from 1 runs under" in (out / "leaderboard.md").read_text()  # the runs', not carried


def test_render_restores_archived_parts_missing_here(tmp_path):
    """A board rendered (or a sweep run) on a machine that has only some of its runs reads the
    others from the archived answers (so their samples pair), and leaves parts that are here
    alone; a part whose folder is here without answers (a run stopped before its first) counts
    as missing."""
    work, out = tmp_path / "work", tmp_path / "board"
    archived_part = b'{"header": {}}\n{"task": "ruler/vt"}\n'
    (out / "answers").mkdir(parents=True)
    for part in ("base-1of2", "base-2of2", "adapter-1of2"):
        (out / "answers" / f"{part}.records.jsonl.gz").write_bytes(gzip.compress(archived_part))
    (work / "adapter-1of2").mkdir(parents=True)
    (work / "adapter-1of2" / "records.jsonl").write_text("here\n")
    (work / "base-2of2").mkdir()
    assert lb_archives.restore_missing_parts(out, work) == [work / "base-1of2", work / "base-2of2"]
    assert (work / "base-1of2" / "records.jsonl").read_bytes() == archived_part
    assert (work / "base-2of2" / "records.jsonl").read_bytes() == archived_part
    assert (work / "adapter-1of2" / "records.jsonl").read_text() == "here\n"
    assert lb_archives.restore_missing_parts(out, work) == []


def test_render_rewrites_the_records_of_peer_parts_behind_their_answers(tmp_path, monkeypatch):
    """A kvpress part writes its records when it stops: render brings those of a running or
    killed part up to date first, and leaves the others alone."""
    import os
    import subprocess

    work = tmp_path / "work"
    stale, fresh, ours = work / "kvpress-2of2", work / "kvzip-1of2", work / "base-1of2"
    for part in (stale, fresh, ours):
        part.mkdir(parents=True)
        (part / "records.jsonl").write_text("")
        if part is not ours:
            (part / "kvpress-results.jsonl").write_text("")
    os.utime(stale / "records.jsonl", (0, 0))  # older than its answers
    # newer than its answers, set outright: written one after the other, the two files' times
    # fall in one clock tick or in two, as it happens
    later = (fresh / "kvpress-results.jsonl").stat().st_mtime + 60
    os.utime(fresh / "records.jsonl", (later, later))
    (work / "kvpress-1of2").mkdir()  # no answers yet: nothing to write
    ran = []
    monkeypatch.setattr(subprocess, "run", lambda command, **_: ran.append(command)
                        or subprocess.CompletedProcess(command, 0, "", ""))  # fmt: skip

    class Args:
        kvpress_python, model, length, samples = "kvpython", "smollm2-135m", 4096, 20
        board = tmp_path / "board"

    lb_lanes.refresh_peer_records(Args, lb_plans.PLANS[("smollm2-135m", 4096)], work)
    (command,) = ran
    assert command[-1] == "--records-only" and command[command.index("--out") + 1] == str(stale)
    tasks = command[command.index("--tasks") + 1].split(",")
    assert tasks == lb_plans.task_parts(2)[1]  # the second part's tasks


def lanes_ran(tmp_path, monkeypatch, fake_run, lanes: list[int] | None = None) -> None:
    """Run the Qwen 16K plan's base and adapter sweeps through `fake_run` (subprocess.run), in
    `lanes` only if given."""
    import subprocess
    from types import SimpleNamespace

    monkeypatch.setattr(subprocess, "run", fake_run)
    args = SimpleNamespace(model="qwen2.5-coder-0.5b", length=16384, samples=4, jobs=2,
                           kvpress_python="kvpython", board=tmp_path / "board",
                           lanes=lanes or [])  # fmt: skip
    plan = lb_plans.PLANS[("qwen2.5-coder-0.5b", 16384)]
    sweeps = lb_plans.sweeps(plan)
    lb_lanes.run_sweeps(args, plan, [sweeps["base"], sweeps["adapter"]], tmp_path / "work")


def part_of(command: list[str]) -> str:
    return Path(command[command.index("--out") + 1]).name


def test_a_lane_goes_on_to_the_next_sweep_without_waiting_for_the_other_lane(tmp_path, monkeypatch):
    """Each task group runs its part of every sweep in turn, and the groups run side by side:
    the second group starts its adapter part while the first is still in its base part."""
    import subprocess
    import threading

    second_moved_on = threading.Event()
    ran = []

    def fake_run(command, **_):
        part = part_of(command)
        ran.append(part)
        if part == "adapter-2of2":
            second_moved_on.set()
        if part == "base-1of2":
            assert second_moved_on.wait(timeout=30), "the second lane waited for the first"
        return subprocess.CompletedProcess(command, 0)

    lanes_ran(tmp_path, monkeypatch, fake_run)
    assert sorted(ran) == ["adapter-1of2", "adapter-2of2", "base-1of2", "base-2of2"]
    assert ran.index("base-1of2") < ran.index("adapter-1of2")
    assert ran.index("base-2of2") < ran.index("adapter-2of2") < ran.index("adapter-1of2")
    assert (tmp_path / "work" / "adapter-2of2.log").is_file()


def test_a_failing_part_ends_its_lane_and_the_run_names_its_log(tmp_path, monkeypatch):
    import subprocess

    ran = []

    def fake_run(command, **_):
        ran.append(part_of(command))
        return subprocess.CompletedProcess(command, 1 if part_of(command) == "base-2of2" else 0)

    with pytest.raises(SystemExit, match=r"base-2of2\.log"):
        lanes_ran(tmp_path, monkeypatch, fake_run)
    assert sorted(ran) == ["adapter-1of2", "base-1of2", "base-2of2"]  # not adapter-2of2


def test_only_the_lanes_asked_run_and_a_lane_not_there_is_refused(tmp_path, monkeypatch):
    import subprocess

    ran = []

    def fake_run(command, **_):
        ran.append(part_of(command))
        return subprocess.CompletedProcess(command, 0)

    lanes_ran(tmp_path, monkeypatch, fake_run, lanes=[2])
    assert ran == ["base-2of2", "adapter-2of2"]
    for asked, said in [("3", "the lanes are 1 to 2"), ("two", "takes lane numbers")]:
        with pytest.raises(UserError, match=said):
            run(Options(model="qwen2.5-coder-0.5b", length=16384, jobs=2, lanes=asked))
