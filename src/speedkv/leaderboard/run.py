"""`speedkv leaderboard run` and `render`: speedkv's methods and kvpress's presses on the same
RULER samples, each sweep resumable (a stopped run picks up where it was), then the board:
per-method RULER average in both settings with KV and TTFT ratios, per-task tables, and the
Pareto plot.

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
resumes from them, so a long sweep can go on on another machine. A render first restores
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

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from speedkv.errors import UserError
from speedkv.leaderboard.archives import archive_answers
from speedkv.leaderboard.lanes import lanes_asked, run_sweeps, run_ttft
from speedkv.leaderboard.plans import (
    PLANS,
    Plan,
    Sweep,
    best_presses,
    split_commas,
    sweeps,
    task_parts,
)
from speedkv.leaderboard.render import render


@dataclass
class Options:
    """What `speedkv leaderboard run` was asked (the names the sweeps' functions read)."""

    model: str = "smollm2-135m"
    length: int = 4096  # RULER length (prompt + answer)
    samples: int | None = None  # per task, for every sweep (None: the plan's)
    presses: str | None = None  # kvpress's presses, comma-separated (None: the plan's)
    run: str = ""  # sweeps, comma-separated, or all; none: only the board
    jobs: int = 2
    lanes: str | list[int] = ""  # lanes (task groups) to run, 1 to jobs; none: all
    kvpress_python: str = ".venv-kvpress/bin/python"
    work: Path = Path("runs/ruler-leaderboard")
    out: Path | None = None  # the board's folder (None: benchmarks/ruler/MODEL-LENGTH)
    render: bool = False
    archive: bool = False
    docs: Path | None = None  # also refresh this page's fenced copy of the tables
    board: Path | None = None  # set by `run`: --out, or benchmarks/ruler/MODEL-LENGTH


def plan_of(model: str, length: int) -> Plan:
    plan = PLANS.get((model, length))
    if plan is None:
        known = ", ".join(f"{m} at {n}" for m, n in PLANS)
        raise UserError(f"no leaderboard plan for {model} at {length}; planned: {known}")
    return plan


def run(args: Options) -> None:
    """Run the sweeps asked for, archive and render as asked (a call that asks for neither
    sweeps nor an archive renders)."""
    work = args.work / args.model / str(args.length)
    plan = plan_of(args.model, args.length)
    if args.presses:
        plan = dataclasses.replace(plan, presses=args.presses)
    if args.samples:  # one count for every sweep
        plan = dataclasses.replace(plan, samples=args.samples, kvzip_samples=None)
    args = dataclasses.replace(args)  # the functions below read the plan's samples and lanes
    args.samples = plan.samples
    args.lanes = lanes_asked(str(args.lanes), len(task_parts(args.jobs)))
    args.board = args.out or Path("benchmarks/ruler") / f"{args.model}-{args.length}"
    plan_sweeps = sweeps(plan)
    wanted = split_commas(args.run)
    if wanted == ["all"]:
        wanted = [*plan_sweeps, "ttft"]
    unknown = [w for w in wanted if w not in plan_sweeps and w != "ttft"]
    if unknown:
        raise UserError(
            f"unknown sweep {', '.join(unknown)}; known: {', '.join(plan_sweeps)}, ttft"
        )
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
