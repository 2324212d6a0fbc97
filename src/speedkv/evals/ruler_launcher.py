"""Runs RULER's generator scripts as forked children of one process that has already imported
what they import.

Each generator is a script (`python niah.py ARGS`) that spends most of a short task importing
nltk, transformers and scipy: about 9 of the 13 seconds of a 1K-token task. Here one process
imports them once, and each task still runs in a process of its own, forked from it, exactly as
the script runs from a shell: its own globals, arguments, working directory and output files.
`workers` run at a time.

A job's `timeout` counts the CPU seconds it uses, not wall seconds: the limit is there for a
generator that loops forever (RULER's haystack step never stops when its text cannot fit), and a
busy machine must not pass for one. The kernel stops a job at its CPU limit (RLIMIT_CPU); one
that sits idle for WALL_PER_CPU times its limit is killed as hung.

    python -m speedkv.evals.ruler_launcher < request.json > results.json

request: {"workers": N, "jobs": [{"script", "args", "cwd", "stdout", "stderr", "timeout"}]}
results: one {"returncode": int | None, "timed_out": bool} per job, in order.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import resource
import runpy
import signal
import sys
import time
import traceback
from typing import NoReturn

WALL_PER_CPU = 10  # wall seconds per second of its CPU limit after which a job counts as hung

# what the generators import, heaviest first; one that is missing is the script's to report.
# `transformers` alone is lazy: its tokenizer classes, which every script loads, take seconds more
PRELOAD = (
    "transformers",
    "transformers.models.auto.tokenization_auto",
    "transformers.tokenization_utils_tokenizers",
    "nltk.tokenize",
    "scipy.special",
    "numpy",
    "wonderwords",
    "tqdm",
    "long_context_eval.pred.nemo_utils",
)


def preload() -> None:
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def _open_for_writing(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


def script_path(script: str) -> None:
    """sys.path as `python SCRIPT` starts it: its first entry is the script's folder (RULER's
    variable_tracking.py imports the `constants` beside it) where `python -m` put the current
    directory; under -P (safe_path) neither adds one, so nothing changes."""
    if not sys.flags.safe_path:
        sys.path[0] = os.path.dirname(os.path.abspath(script))


def run_job(job: dict) -> NoReturn:
    """In the child: run the script as `python SCRIPT ARGS` would, then leave at once (no
    cleanup of what the parent owns)."""
    os.dup2(_open_for_writing(job["stdout"]), 1)
    os.dup2(_open_for_writing(job["stderr"]), 2)
    limit = max(1, math.ceil(job["timeout"]))  # a fork starts with no CPU time of its own
    resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 1))  # SIGXCPU, then SIGKILL
    code = 0
    try:
        os.chdir(job["cwd"])
        sys.argv = [job["script"], *job["args"]]
        script_path(job["script"])
        runpy.run_path(job["script"], run_name="__main__")
    except SystemExit as done:
        if isinstance(done.code, str):
            print(done.code, file=sys.stderr)
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_jobs(jobs: list[dict], workers: int) -> list[dict]:
    results: list[dict] = [{} for _ in jobs]
    pending = list(range(len(jobs)))
    running: dict[int, tuple[int, float]] = {}  # pid: (job, deadline)
    while pending or running:
        while pending and len(running) < workers:
            index = pending.pop(0)
            pid = os.fork()
            if pid == 0:
                run_job(jobs[index])
            hung_after = jobs[index]["timeout"] * WALL_PER_CPU
            running[pid] = (index, time.monotonic() + hung_after)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            index, _ = running.pop(pid)
            results[index] = finished(status)
            continue
        now = time.monotonic()
        for late, (index, deadline) in list(running.items()):
            if now > deadline:
                os.kill(late, signal.SIGKILL)
                os.waitpid(late, 0)
                del running[late]
                results[index] = {"returncode": None, "timed_out": True}
        time.sleep(0.05)
    return results


def finished(status: int) -> dict:
    """A job's result from its wait status: stopped by its CPU limit counts as timed out."""
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL):
        return {"returncode": None, "timed_out": True}
    return {"returncode": os.waitstatus_to_exitcode(status), "timed_out": False}


def main() -> None:
    request = json.load(sys.stdin)
    preload()
    json.dump(run_jobs(request["jobs"], max(1, int(request["workers"]))), sys.stdout)


if __name__ == "__main__":
    main()
