"""Running a plan's sweeps: each sweep's tasks split into --jobs groups (parts), run in lanes
side by side, each part a `speedkv eval` or a kvpress peer run of one thread; then the quiet
TTFT bench, alone."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from speedkv.errors import UserError
from speedkv.leaderboard.archives import restore_missing_parts, resume_file
from speedkv.leaderboard.peers import recorded_attention
from speedkv.leaderboard.plans import DTYPE, Plan, Sweep, split_commas, sweeps, task_parts
from speedkv.leaderboard.repo import KVPRESS_PEER, ROOT, SPEEDKV


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
        sys.executable, str(KVPRESS_PEER),
        "--kvpress-python", args.kvpress_python, "--model", args.model,
        "--tasks", ",".join(tasks), "--length", str(args.length),
        "--samples", str(sweep.samples or args.samples), "--presses", ",".join(sweep.methods),
        "--ratios", plan.compression_ratios(), "--settings", plan.kvpress_settings(),
        "--threads", "1", "--out", str(out), "--resume", *peer_attention(out.parent),
    ]  # fmt: skip


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


def lanes_asked(text: str, jobs: int) -> list[int]:
    """The lane numbers of --lanes (1-based), or [] for all of them."""
    try:
        lanes = [int(w) for w in split_commas(text)]
    except ValueError:
        raise UserError(f"--lanes takes lane numbers, comma-separated (got {text!r})") from None
    if any(not 1 <= lane <= jobs for lane in lanes):
        raise UserError(f"--lanes: with --jobs {jobs} the lanes are 1 to {jobs} (got {text!r})")
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
