"""`speedkv` commands, each in a process of its own, that start with speedkv's libraries imported.

Most of a short command's time is importing torch and transformers (about 8 of 14 s for a
4-token `generate` on one thread). Here a server process imports them once (multiprocessing's
forkserver, with `PRELOAD`), and each command is forked from it and runs the installed `speedkv`
script as `speedkv ARGS` would: its own arguments, working directory, output files and exit
status. The server's environment is fixed when it starts (OpenMP reads OMP_NUM_THREADS as torch
loads), so every command of one runner shares it."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

PRELOAD = [
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "speedkv.cli.app",
]


def _run_script(script: str, args: list[str], cwd: str, out: str, err: str) -> None:
    """In the forked child: `script ARGS` in `cwd`, its output to the two files."""
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.chdir(cwd)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")  # its sys.exit is the process's exit status


class PreloadedCli:
    """Runs `script` with arguments as forked processes of one preloaded server."""

    def __init__(self, script: str, env: dict[str, str]) -> None:
        self.script = script
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(PRELOAD)
        # the server inherits this process's environment as it starts, here and only here
        with pytest.MonkeyPatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            multiprocessing.forkserver.ensure_running()

    def run(self, args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            child = self.context.Process(
                target=_run_script, args=(self.script, args, str(cwd), str(out), str(err))
            )
            child.start()
            child.join(timeout)
            if child.exitcode is None:
                child.kill()
                child.join()
                raise subprocess.TimeoutExpired([self.script, *args], timeout)
            said = [path.read_text() if path.exists() else "" for path in (out, err)]
            return subprocess.CompletedProcess([self.script, *args], child.exitcode, *said)
