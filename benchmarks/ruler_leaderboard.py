"""RULER leaderboard: speedkv's methods and kvpress's presses on the same RULER samples.

Runs every sweep the leaderboard needs, each resumable (a stopped run picks up where it was),
then writes the leaderboard: per-method RULER average in both settings with KV and TTFT ratios,
per-task tables, and the Pareto plot.

    .venv/bin/python benchmarks/ruler_leaderboard.py --run all --jobs 2   # make ruler-leaderboard
    .venv/bin/python benchmarks/ruler_leaderboard.py --run base,adapter --jobs 2
    .venv/bin/python benchmarks/ruler_leaderboard.py --render               # tables and plot only
    .venv/bin/python benchmarks/ruler_leaderboard.py --model qwen2.5-coder-0.5b --length 16384 \
        --run base,adapter,kvpress --jobs 2

--model and --length pick a plan (PLANS): SmolLM2 at 4K has every row and both settings;
SmolLM2 at 8K (8064 tokens: every prompt with its answer in SmolLM2's 8192) and Qwen2.5-0.5B at
4K and 16K check the main rows (full, SPEED with and without its adapter, SnapKV or kvpress's
best presses), with fewer samples where a prefill costs more.

Sweeps (OUT = --work/MODEL/LENGTH):
  base      our methods, untrained, question in view (RULER's prompt as it is), SPEED's cutoffs
            and every peer at SPEED's KV ratio (0.733 at SmolLM2's cut of 22)
  adapter   full and SPEED with the shipped SPEED-aware adapter merged (its rows kept apart:
            the adapter was trained on Paul Graham essays, RULER's haystack)
  agnostic  full and SPEED with each sample's context cached before its question is seen
            (--query-agnostic); the other methods choose their cache with the question in view
            and cannot run so
  kvpress   kvpress's presses through its own pipeline (benchmarks/kvpress_peer.py, in
            .venv-kvpress: make kvpress-venv), both settings, at the KV ratios SPEED reaches
            (SmolLM2: SPEED-22's 0.733 and SPEED-26's 0.867): SnapKV, ExpectedAttention,
            StreamingLLM, TOVA and Knorm, and press=None (its ceiling)
  kvzip     kvpress's KVzip the same way, against its own answers without a press (it replays
            the context to score it: about five prefills a sample); SmolLM2 at 4K, and
            Qwen2.5-0.5B at 4K on 5 samples a task
  ttft      a quiet `speedkv bench` at the length: the TTFT ratios the table shows for our
            methods (the sweeps' own per-sample ratios are taken on a shared CPU)

Sweeps take hours. `--archive` stores each part's answers so far beside the leaderboard
(benchmarks/ruler/MODEL-LENGTH/answers/); a sweep started where its part has no answers yet
resumes from them, so a long sweep can go on on another machine. `--render` first restores
every archived part that has no folder under --work (so all rows pair their samples), and keeps
the published rows (results.json) of sweeps with neither runs nor archived answers.

--jobs N splits each sweep's tasks into N groups, each run by a process of one thread (keep N
for a sweep's life: a stopped sweep resumes with the same task groups). The sweeps asked for
run in N lanes side by side, one per group: a lane goes through its group of every sweep in
turn, so a core whose group is done starts on the next sweep at once instead of waiting for
the others. Only `ttft` needs the CPU to itself: it runs after the lanes before it end.
--lanes K[,K...] runs only those lanes (1 to N), for a core that is free while the others are
still busy, or to share a board's lanes between machines (then --archive on each).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from speedkv.cli.options import split_commas
from speedkv.evals import leaderboard as lb
from speedkv.evals import ruler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpress_peer import recorded_attention  # noqa: E402  (the script beside this one)

ROOT = Path(__file__).resolve().parent.parent
SPEEDKV = str(Path(sys.executable).with_name("speedkv"))  # this environment's CLI
# kvpress's presses at SPEED's KV ratio; KVzip is a sweep of its own: it replays the context
# to score it, about five prefills a sample
KVPRESS_PRESSES = "snapkv,expected_attention,streaming_llm,tova,knorm"
KVZIP = "kvzip"
# every board in bfloat16, kvpress's rows too, so no row depends on the CPU that made it
# (speedkv's `auto` is float32 on a CPU without bf16 matrix instructions)
DTYPE = "bfloat16"


@dataclass
class Sweep:
    name: str
    methods: list[str]
    args: list[str] = field(default_factory=list)
    peer: bool = False  # kvpress, not speedkv eval
    # its press=None answers are only its own ratios' reference; the `kvpress` sweep's make the
    # board's no-press row
    reference_only: bool = False
    samples: int | None = None  # per task, where not the plan's


@dataclass(frozen=True)
class Plan:
    """What the leaderboard measures for one model at one length. deep=1 is spelled out in
    SPEED's rows: the paper's suffix, and the one the shipped adapters were trained with."""

    kv: float  # SPEED's KV ratio at its main cutoff: the budget every peer gets
    speed: tuple[str, ...]  # SPEED's untrained rows
    peers: tuple[str, ...]  # speedkv's other methods, at `kv`
    adapter: str  # the shipped SPEED-aware adapter for this model
    trained: tuple[str, ...]  # rows run with the adapter merged
    agnostic: tuple[str, ...]  # rows run with the context cached before the question
    presses: str  # kvpress's presses, at `kv` and at each of `more_kv`
    samples: int  # per task
    kvzip: bool = False
    kvzip_samples: int | None = None  # per task, where fewer than `samples` (its replays cost)
    more_kv: tuple[float, ...] = ()  # other KV ratios SPEED reaches here, for kvpress too
    # full and SPEED start from one full prefill per sample (speedkv eval --shared-prefill):
    # the same answers for about one prefill a sample; SPEED's TTFT then comes from `ttft`
    shared_prefill: bool = True

    def kvpress_settings(self) -> str:
        """kvpress's --settings: the settings speedkv's rows have in this plan, so every press
        is compared in a setting SPEED was measured in (a plan without query-agnostic rows
        spends no prefills on kvpress's)."""
        return "aware,agnostic" if self.agnostic else "aware"

    def compression_ratios(self) -> str:
        """kvpress's --ratios: the share of entries each press removes, one per KV ratio."""
        return ",".join(f"{1 - kv:.3f}" for kv in (self.kv, *self.more_kv))


def smollm2_peers(kv: float) -> tuple[str, ...]:
    return (
        f"snapkv:retain={kv},gqa=true",  # one copy per KV head: equal KV (gqa=false keeps 3)
        f"streamingllm:window={kv}",
        "pop:lcut=22",
        "swiftkv:k=22",
        f"fastkv:retain={kv}",  # the authors' TSP rate 0.2 caps the upper layers: KV ~0.47
        f"fastkv:tsp_rate={kv},retain={kv}",  # the same KV as SPEED
        f"specprefill:keep={kv}",
        f"gemfilter:retain={kv}",
        f"h2o:heavy={kv / 2:.4f},recent={kv / 2:.4f}",
        "pyramidinfer",
    )


SMOLLM2_8K = ("smollm2-135m", 8192 - ruler.longest_answer())  # 8064: room for every answer
SMOLLM2_KV = 0.733  # SPEED-22 on SmolLM2: 22 of 30 layers hold the prompt
SMOLLM2_KV26 = 0.867  # SPEED-26: 26 of 30
SPEED22 = "speed:lcut=22,anchors=bos,deep=1"
SPEED26 = "speed:lcut=26,anchors=bos,deep=1"
SPEED22_DEEP64 = "speed:lcut=22,anchors=bos,deep=64"  # speedkv's default deep suffix
SMOLLM2_ADAPTER = "adapters/smollm2-135m-speed22-bos"
QWEN_SPEED18 = "speed:lcut=18,anchors=sink:4,deep=1"  # 18 of 24 layers, the adapter's cut
QWEN_ADAPTER = "adapters/qwen2.5-coder-0.5b-speed18-sink4"

QWEN_PLAN = Plan(
    kv=0.75,
    speed=(QWEN_SPEED18,),
    peers=(),
    adapter=QWEN_ADAPTER,
    trained=("full", QWEN_SPEED18),
    agnostic=(),
    presses="best:1",  # the SmolLM2 4K board's best press (best_presses; --presses overrides)
    samples=10,
)
# KVzip, the 4K board's best press but about five prefills a sample, checked on the second
# model at 4K on half the samples: against its own no-press answers, as on SmolLM2
QWEN_PLAN_4K = dataclasses.replace(QWEN_PLAN, kvzip=True, kvzip_samples=5)

# the main board, whose kvpress sweep names the best presses for the later plans
BOARD_4K = Path(__file__).resolve().parent / "ruler" / "smollm2-135m-4096"

PLANS: dict[tuple[str, int], Plan] = {
    ("smollm2-135m", 4096): Plan(
        kv=SMOLLM2_KV,
        speed=(SPEED22, SPEED26, SPEED22_DEEP64),
        peers=smollm2_peers(SMOLLM2_KV),
        adapter=SMOLLM2_ADAPTER,
        trained=("full", SPEED22, SPEED22_DEEP64),
        agnostic=("full", SPEED22, SPEED26, SPEED22_DEEP64),
        presses=KVPRESS_PRESSES,
        samples=20,
        kvzip=True,
        more_kv=(SMOLLM2_KV26,),  # kvpress also at SPEED-26's ratio
        shared_prefill=False,  # measured before the sweeps could share one
    ),
    # the 8K check: SPEED, its adapter and SnapKV; the 4K board's two best kvpress presses. At
    # 8192 - 128: SmolLM2's context is 8192, and RULER fits its text to the length (fwe all of
    # it, then 50 answer tokens), so at 8192 fwe's prompt and answer take 8257 with the template
    SMOLLM2_8K: Plan(
        kv=SMOLLM2_KV,
        speed=(SPEED22, SPEED22_DEEP64),
        peers=(f"snapkv:retain={SMOLLM2_KV},gqa=true",),
        adapter=SMOLLM2_ADAPTER,
        trained=("full", SPEED22),
        agnostic=(),
        presses="best:2",
        samples=10,  # an 8K prefill costs about twice a 4K one
        kvzip=True,  # the 4K board's best press, a sweep of its own (not among best:2)
        kvzip_samples=3,  # about 4 minutes a sample on one core at 8K: its replays cost
    ),
    # Qwen2.5-0.5B: a prefill of 4K tokens is about four times SmolLM2's, of 16K about twenty
    # times, so fewer samples a task
    ("qwen2.5-coder-0.5b", 4096): QWEN_PLAN_4K,
    ("qwen2.5-coder-0.5b", 16384): dataclasses.replace(QWEN_PLAN, samples=4),
}


def best_presses(work: Path, n: int, published: Path = BOARD_4K / "results.json") -> str:
    """kvpress's `n` best presses on the SmolLM2 4K board (its `kvpress` sweep under `work`, and
    the published board's rows where its runs are not there): by RULER average over both
    settings at SPEED-22's KV ratio. Refuses until every press has every task at the board's
    samples: a choice from part of the tasks would be another one."""
    board = PLANS[("smollm2-135m", 4096)]
    ratio = board.compression_ratios().split(",")[0]
    dirs = sorted(
        p.parent for p in (work / "smollm2-135m" / "4096").glob("kvpress-*/records.jsonl")
    )
    on_record = lb.rows_from_json(json.loads(published.read_text())) if published.exists() else []
    rows, _ = lb.with_published(lb.rows_from_runs(dirs), on_record)
    expected = set(split_commas(board.presses))
    rows = [  # the `kvpress` sweep's presses (KVzip, a sweep of its own, is not among them)
        r
        for r in rows
        if r.method.startswith("kvpress:")
        and f"ratio={float(ratio):g}" in r.method
        and press_of(r) in expected
    ]
    ready = [r for r in rows if r.average is not None and r.min_samples >= board.samples]
    names = {press_of(r) for r in rows}
    if not (len(ready) == len(rows) == 2 * len(expected) and names == expected):
        raise SystemExit(
            "the SmolLM2 4K board's kvpress sweep is not complete, so its best presses are not "
            "known yet: run `benchmarks/ruler_leaderboard.py --run kvpress` first, or name the "
            "presses with --presses"
        )
    by_press: dict[str, list[float]] = {}
    for r in ready:
        by_press.setdefault(press_of(r), []).append(r.average)
    ranked = sorted(by_press, key=lambda press: -sum(by_press[press]) / 2)
    return ",".join(ranked[:n])


def press_of(row: lb.Row) -> str:
    """The press of a kvpress row (`kvpress:<press>,ratio=...`)."""
    return row.method.split(":")[1].split(",")[0]


def sweeps(plan: Plan) -> dict[str, Sweep]:
    """The sweeps of one plan (a plan without agnostic rows has no agnostic sweep)."""
    shared = ["--shared-prefill"] if plan.shared_prefill else []
    out = {
        "base": Sweep("base", ["full", *plan.speed, *plan.peers], shared),
        "adapter": Sweep("adapter", list(plan.trained), ["--adapter", plan.adapter, *shared]),
        "agnostic": Sweep("agnostic", list(plan.agnostic), ["--query-agnostic"]),
        "kvpress": Sweep("kvpress", [plan.presses], peer=True),
        "kvzip": Sweep(
            "kvzip", [KVZIP], peer=True, reference_only=True, samples=plan.kvzip_samples
        ),
    }
    if not plan.agnostic:
        del out["agnostic"]
    if not plan.kvzip:
        del out["kvzip"]
    return out


def task_parts(jobs: int) -> list[list[str]]:
    """RULER's tasks in `jobs` runs of consecutive tasks, in RULER's order (a stopped sweep
    resumes only with the same groups, so they never change for a given N)."""
    size = -(-len(ruler.TASKS) // jobs)
    return [list(ruler.TASKS[i : i + size]) for i in range(0, len(ruler.TASKS), size)]


def part_dirs(work: Path, sweep: str, jobs: int) -> list[Path]:
    return [work / f"{sweep}-{i + 1}of{jobs}" for i in range(jobs)]


def eval_command(model: str, length: int, samples: int, sweep: Sweep, tasks: list[str], out: Path):
    return [
        SPEEDKV, "eval", "--model", model, "--dtype", DTYPE,
        "--methods", ";".join(sweep.methods), "--tasks", ",".join(tasks),
        "--lengths", str(length), "--samples", f"ruler={samples}", "--seed", "0",
        "--threads", "1", "--out", str(out), "--resume", *sweep.args,
    ]  # fmt: skip


def peer_attention(work: Path) -> list[str]:
    """`--attention` for a peer part: what the board's earliest peer answers under `work` were
    made with (run_sweeps restores the archived ones first), so every kvpress row of a board
    (and the full-attention row they share) computes its attention alike. Nothing while no
    peer part has answers: the first one then decides."""
    for results in sorted(work.glob("*-*of*/kvpress-results.jsonl")):
        with open(results) as lines:
            first = lines.readline()
        header = json.loads(first).get("header") if first.strip() else None
        if header:
            return ["--attention", recorded_attention(header)]
    return []


def kvpress_command(args, plan: Plan, sweep: Sweep, tasks: list[str], out: Path) -> list[str]:
    return [
        sys.executable, str(ROOT / "benchmarks" / "kvpress_peer.py"),
        "--kvpress-python", args.kvpress_python, "--model", args.model,
        "--tasks", ",".join(tasks), "--length", str(args.length),
        "--samples", str(sweep.samples or args.samples), "--presses", ",".join(sweep.methods),
        "--ratios", plan.compression_ratios(), "--settings", plan.kvpress_settings(),
        "--threads", "1", "--out", str(out), "--resume", *peer_attention(out.parent),
    ]  # fmt: skip


def resume_file(part: Path) -> Path:
    """What a stopped part resumes from: kvpress's raw answers, or speedkv eval's records."""
    raw = part / "kvpress-results.jsonl"
    return raw if part.name.startswith(("kvpress-", "kvzip-")) else part / "records.jsonl"


def archived(board: Path, part: Path) -> Path:
    return board / "answers" / f"{part.name}.{resume_file(part).name}.gz"


def archive_answers(work: Path, board: Path) -> list[Path]:
    """Copy every part's answers so far into the board's folder (gzip, no timestamp, so an
    unchanged part gives the same bytes): a sweep stopped here resumes from them on another
    machine. Returns the files written."""
    written = []
    for part in sorted(p for p in work.glob("*-*of*") if p.is_dir()):
        source = resume_file(part)
        if not source.exists():
            continue
        target = archived(board, part)
        answers = source.read_bytes()
        if target.exists() and gzip.decompress(target.read_bytes()).startswith(answers):
            continue  # the archive holds all of this copy (one restored here before it grew)
        target.parent.mkdir(parents=True, exist_ok=True)
        with gzip.GzipFile(target, "wb", mtime=0) as sink:
            sink.write(answers)
        written.append(target)
    return written


def restore_answers(board: Path, part: Path) -> bool:
    """Seed a part that has nothing yet from the board's archived answers (see
    archive_answers). Returns whether it did."""
    source, target = archived(board, part), resume_file(part)
    if target.exists() or not source.exists():
        return False
    part.mkdir(parents=True, exist_ok=True)
    target.write_bytes(gzip.decompress(source.read_bytes()))
    return True


def part_command(args, plan: Plan, sweep: Sweep, tasks: list[str], out: Path) -> list[str]:
    """One task group's run of a sweep (run_sweeps has restored its archived answers)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if sweep.peer:
        return kvpress_command(args, plan, sweep, tasks, out)
    return eval_command(args.model, args.length, args.samples, sweep, tasks, out)


def run_lane(args, plan: Plan, sweeps: list[Sweep], work: Path, part: int) -> str | None:
    """Task group `part` of each sweep in turn, each logging to OUT.log; the first that fails
    ends the lane. Returns that one's log, or None."""
    tasks = task_parts(args.jobs)[part]
    for sweep in sweeps:
        out = part_dirs(work, sweep.name, args.jobs)[part]
        command = part_command(args, plan, sweep, tasks, out)
        log_path = out.with_suffix(".log")
        print(f"[{sweep.name}] {shlex.join(command)}\n[{sweep.name}] progress and ETA: "
              f"tail -f {log_path}", file=sys.stderr)  # fmt: skip
        with open(log_path, "a") as log:
            if subprocess.run(command, stdout=log, stderr=log, cwd=ROOT).returncode != 0:
                return str(log_path)
    return None


def lanes_asked(text: str, jobs: int, parser: argparse.ArgumentParser) -> list[int]:
    """The lane numbers of --lanes (1-based), or [] for all of them."""
    try:
        lanes = [int(w) for w in split_commas(text)]
    except ValueError:
        parser.error(f"--lanes takes lane numbers, comma-separated (got {text!r})")
    if any(not 1 <= lane <= jobs for lane in lanes):
        parser.error(f"--lanes: with --jobs {jobs} the lanes are 1 to {jobs} (got {text!r})")
    return sorted(set(lanes))


def run_sweeps(args, plan: Plan, sweeps: list[Sweep], work: Path) -> None:
    """Sweeps one after another, their task groups in `args.jobs` lanes that run side by side:
    a lane goes on to its group of the next sweep as soon as its own is done, so no core waits
    for the slowest group of each sweep, only of the last. Every part archived beside the board
    and without answers here is restored first: a part on another machine resumes from the
    board's answers so far, and a peer part reads the attention they were made with."""
    restore_missing_parts(args.board, work)
    parts = [lane - 1 for lane in args.lanes] if args.lanes else range(len(task_parts(args.jobs)))
    with ThreadPoolExecutor(max_workers=len(parts)) as pool:
        failed = [f for f in pool.map(lambda i: run_lane(args, plan, sweeps, work, i), parts) if f]
    if failed:
        raise SystemExit(f"[{', '.join(s.name for s in sweeps)}] failed; see {', '.join(failed)}")


def run_ttft(args, work: Path, methods: list[str]) -> None:
    command = [
        SPEEDKV, "bench", "--model", args.model, "--dtype", DTYPE,
        "--methods", ";".join(methods), "--lengths", str(args.length),
        "--max-new-tokens", "4", "--repeats", "3", "--out", str(work / "ttft"),
    ]  # fmt: skip
    print(f"[ttft] {shlex.join(command)}", file=sys.stderr)
    subprocess.run(command, check=True, cwd=ROOT)


def docs_markers(name: str) -> tuple[str, str]:
    """The comments that fence a docs page's copy of one leaderboard's tables."""
    return (f"<!-- ruler tables {name}: written by benchmarks/ruler_leaderboard.py --render "
            "--docs; edit the prose around them -->", f"<!-- /ruler tables {name} -->")  # fmt: skip


def refresh_docs(page: str, name: str, tables: str) -> str:
    """`page` with the fenced tables of leaderboard `name` replaced by `tables`."""
    begin, end = docs_markers(name)
    if page.count(begin) != 1 or page.count(end) != 1 or page.index(begin) > page.index(end):
        raise SystemExit(f"the page has no single fenced region for {name}; fence the tables "
                         f"with\n{begin}\n...\n{end}")  # fmt: skip
    head, rest = page.split(begin)
    return head + begin + "\n\n" + tables.strip() + "\n\n" + end + rest.split(end, 1)[1]


def refresh_peer_records(args, plan: Plan, work: Path) -> None:
    """Rewrite the records of every kvpress part whose answers are newer than them: a part
    writes its records when it stops, so a board rendered while it runs, or after it was
    killed, would show fewer answers than there are."""
    for sweep in (s for s in sweeps(plan).values() if s.peer):
        for part in sorted(work.glob(f"{sweep.name}-*of*")):
            index, _, jobs = part.name.removeprefix(f"{sweep.name}-").partition("of")
            answers, records = resume_file(part), part / "records.jsonl"
            if not answers.exists() or (
                records.exists() and records.stat().st_mtime >= answers.stat().st_mtime
            ):
                continue
            tasks = task_parts(int(jobs))[int(index) - 1]
            command = [*kvpress_command(args, plan, sweep, tasks, part), "--records-only"]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                why = done.stderr.strip()[-500:]
                print(f"[render] {part.name}: its records are older than its answers and could "
                      f"not be rewritten: {why}", file=sys.stderr)  # fmt: skip


def restore_missing_parts(board: Path, work: Path) -> list[Path]:
    """Restore each part archived beside the board that has no answers under `work` (see
    restore_answers), saying so: a sweep resumes from them, and a render pairs their samples
    with the others' (published rows keep no per-sample scores). Returns the parts restored."""
    restored = []
    for source in sorted((board / "answers").glob("*-*of*.*.jsonl.gz")):
        part = work / source.name.split(".")[0]
        if restore_answers(board, part):
            print(f"{part.name}: restored from {source}", file=sys.stderr)
            restored.append(part)
    return restored


def render(args, plan: Plan, work: Path, out: Path) -> None:
    restore_missing_parts(out, work)
    refresh_peer_records(args, plan, work)
    dirs = sorted(p.parent for p in work.glob("*/records.jsonl"))
    published_file = out / "results.json"
    published = (
        lb.rows_from_json(json.loads(published_file.read_text())) if published_file.exists() else []
    )
    if not dirs and not published:
        raise SystemExit(f"no runs under {work}: run some sweeps first (--run base)")
    ttft_file = work / "ttft" / "results.json"
    # the quiet bench's ratios: this machine's `ttft` run, else those the published board took
    # from the machine that ran it
    ttft = lb.bench_ttft(ttft_file) if ttft_file.exists() else lb.published_bench_ttft(published)
    # rows whose runs are not here (finished on another machine) keep their published figures
    references = [
        d for s in sweeps(plan).values() if s.reference_only for d in work.glob(f"{s.name}-*of*")
    ]
    rows, carried = lb.with_published(lb.rows_from_runs(dirs, ttft, references), published)
    if carried:
        print(f"{len(carried)} rows as published in {published_file} (no runs of theirs under "
              f"{work})", file=sys.stderr)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    title = f"{args.model}, RULER at {args.length} tokens"
    plot = lb.plot_pareto(rows, args.length, out / "pareto.png", title)
    board = lb.leaderboard_table(rows, args.length)
    per_task = {  # the settings with rows at this length
        setting: lb.task_table(rows, args.length, setting)
        for setting in (lb.AWARE, lb.AGNOSTIC)
        if any(r.setting == setting and r.length == args.length for r in rows)
    }
    parts = [
        f"# {title}\n",
        f"Generated {time.strftime('%Y-%m-%d %H:%M')} by `benchmarks/ruler_leaderboard.py "
        "--render` from "
        + " and ".join(
            ([f"{len(dirs)} runs under {work}"] if dirs else [])
            + ([f"{len(carried)} rows as published before"] if carried else [])
        )
        + ". Scores in percent (RULER's metric per "
        "task; the average is the mean of the 13 tasks, given once every task has samples; ± is "
        "its 95 % margin from the samples' spread in each task). "
        "KV x: cache held at the first token against full attention's on the same prompts. "
        "TTFT x: "
        + (
            "from a quiet `speedkv bench` at this length for speedkv's methods; "
            if any(r.ttft_source == "bench" for r in rows)
            else ""
        )
        + "values marked * are medians of the per-sample ratios in the sweeps (kvpress's "
        "against its own pipeline without a press).\n",
        "## Leaderboard\n",
        board,
    ]
    versus = lb.equal_kv_table(rows, args.length)
    if versus:
        parts += [
            "## SPEED against kvpress at equal KV\n",
            "Each difference comes with its own 95 % margin: paired on the samples both rows "
            "answered where both kept their per-sample scores (marked), else the two rows' "
            "margins combined as independent.\n",
            versus,
        ]
    own = lb.own_reference_table(d for d in references if d in dirs)
    if own:
        parts += [
            "## Presses against their own no-press answers\n",
            "A press whose sweep answers its own press=None reference (KVzip's) against it, on "
            "the same samples, made in the same process on the same CPU.\n",
            own,
        ]
    for setting, table in per_task.items():
        parts += [f"## Per task, {lb.SETTING_LABELS[setting]}\n", table]
    if plot:
        parts += ["## Pareto front\n", f"![RULER against KV and TTFT]({plot.name})\n"]
    hours = sum(r.seconds for r in rows) / 3600
    parts += [f"Samples' wall time, all rows: {hours:.1f} h (CPU shared by the parallel parts).\n"]
    by_sweep: dict[str, list[Path]] = {}
    for directory in dirs:  # a sweep's parts are SWEEP-1ofN ... SWEEP-NofN
        by_sweep.setdefault(directory.name.rsplit("-", 1)[0], []).append(directory)
    lines = []
    for sweep, parts_of_sweep in by_sweep.items():
        machines = lb.answers_by_machine(parts_of_sweep)
        listed = "; ".join(f"{name}: {n} in {s / 3600:.1f} h" for name, (n, s) in machines.items())
        lines.append(f"- `{sweep}`: {listed}\n")
    if lines:
        parts += [f"Answers under {work} by sweep and the CPU that made them, with their "
                  "samples' wall time:\n", "".join(lines)]  # fmt: skip
    (out / "leaderboard.md").write_text("\n".join(parts))
    if args.docs:
        captions = {lb.AWARE: "Per task, question in view (RULER's metric, percent):",
                    lb.AGNOSTIC: "Per task, context cached before the question:"}  # fmt: skip
        tables = [board]
        if versus:
            tables += ["SPEED against kvpress's presses at the same KV ratio:\n", versus]
        if own:
            tables += ["Presses that answer their own no-press reference, against it on the "
                       "same samples and CPU:\n", own]  # fmt: skip
        for setting, table in per_task.items():
            tables += [captions[setting] + "\n", table]
        if plot:
            image = os.path.relpath(plot, args.docs.parent)
            tables += [f"![RULER average against KV and TTFT ratio, Pareto front]({image})"]
        name = f"{args.model}-{args.length}"
        args.docs.write_text(refresh_docs(args.docs.read_text(), name, "\n".join(tables)))
        print(args.docs)
    (out / "results.json").write_text(json.dumps(lb.to_json(rows), indent=1))
    print(out / "leaderboard.md")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=4096, help="RULER length (prompt + answer)")
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help="samples per task, for every sweep (default: the plan's; KVzip's may be fewer)",
    )
    parser.add_argument(
        "--presses", default=None, help="kvpress's presses, comma-separated (default: the plan's)"
    )
    parser.add_argument(
        "--run", default="", help="sweeps to run, comma-separated: base, adapter, agnostic, "
        "kvpress, kvzip, ttft, or all (default: none, only --render)"
    )  # fmt: skip
    parser.add_argument("--jobs", type=int, default=2, help="parallel processes per sweep")
    parser.add_argument(
        "--lanes", default="", help="run only these lanes (task groups), comma-separated, "
        "1 to --jobs (default: all)"
    )  # fmt: skip
    parser.add_argument("--kvpress-python", default=".venv-kvpress/bin/python")
    parser.add_argument("--work", type=Path, default=Path("runs/ruler-leaderboard"))
    parser.add_argument(
        "--out", type=Path, default=None, help="default benchmarks/ruler/MODEL-LENGTH"
    )
    parser.add_argument("--render", action="store_true", help="write the leaderboard")
    parser.add_argument(
        "--archive", action="store_true", help="store every sweep's answers so far in "
        "the --out folder's answers/ (gzip): a sweep run later on another machine resumes from them"
    )  # fmt: skip
    parser.add_argument(
        "--docs", type=Path, default=None, help="with --render: also refresh this page's "
        "fenced copy of the tables (docs/ruler.md)"
    )  # fmt: skip
    args = parser.parse_args()
    work = args.work / args.model / str(args.length)
    plan = PLANS.get((args.model, args.length))
    if plan is None:
        known = ", ".join(f"{m} at {n}" for m, n in PLANS)
        parser.error(f"no leaderboard plan for {args.model} at {args.length}; planned: {known}")
    if args.presses:
        plan = dataclasses.replace(plan, presses=args.presses)
    if args.samples:  # one count for every sweep
        plan = dataclasses.replace(plan, samples=args.samples, kvzip_samples=None)
    args.samples = plan.samples
    args.lanes = lanes_asked(args.lanes, len(task_parts(args.jobs)), parser)
    args.board = args.out or Path("benchmarks/ruler") / f"{args.model}-{args.length}"
    plan_sweeps = sweeps(plan)
    wanted = split_commas(args.run)
    if wanted == ["all"]:
        wanted = [*plan_sweeps, "ttft"]
    unknown = [w for w in wanted if w not in plan_sweeps and w != "ttft"]
    if unknown:
        parser.error(f"unknown sweep {', '.join(unknown)}; known: {', '.join(plan_sweeps)}, ttft")
    lanes: list[Sweep] = []  # the sweeps run together in lanes until `ttft`, which runs alone
    for name in [*wanted, None]:
        if name in ("ttft", None):
            if lanes:
                run_sweeps(args, plan, lanes, work)
                lanes = []
            if name == "ttft":
                ours = [m for s in plan_sweeps.values() if not s.peer for m in s.methods]
                run_ttft(args, work, list(dict.fromkeys(ours)))
            continue
        sweep = plan_sweeps[name]
        if sweep.name == "kvpress" and plan.presses.startswith("best:"):
            chosen = best_presses(args.work, int(plan.presses.split(":")[1]))
            print(f"[kvpress] the 4K board's best presses: {chosen}", file=sys.stderr)
            sweep = dataclasses.replace(sweep, methods=[chosen])
        lanes.append(sweep)
    if args.archive:
        for path in archive_answers(work, args.board):
            print(path)
    if args.render or not (wanted or args.archive):
        render(args, plan, work, args.board)


if __name__ == "__main__":
    main()
