"""RULER's generator scripts run as forked children of one launcher process: each as
`python SCRIPT ARGS` would run it, each failure and timeout reported as its own."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from speedkv.errors import UserError
from speedkv.evals import ruler

SCRIPT = """
import os, sys
from sibling import WORD  # the script's own folder comes first on sys.path
if __name__ == "__main__":
    out = sys.argv[sys.argv.index("--out") + 1]
    with open(out, "w") as f:
        f.write(f"{WORD} {sys.argv[1:]} {os.getcwd()}")
    print("to stdout")
"""


def job(tmp_path: Path, name: str, body: str, args=(), timeout: float = 60) -> dict:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "sibling.py").write_text("WORD = 'sibling'\n")
    script = folder / "script.py"
    script.write_text(body)
    work = folder / "work"
    work.mkdir()
    return {
        "script": str(script),
        "args": list(args),
        "cwd": str(work),
        "stdout": str(folder / "stdout.txt"),
        "stderr": str(folder / "stderr.txt"),
        "timeout": timeout,
    }


def launch(jobs: list[dict], workers: int = 2) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-m", "speedkv.evals.ruler_launcher"],
        input=json.dumps({"workers": workers, "jobs": jobs}),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout)


def test_each_job_runs_as_its_script_would_and_its_failure_is_its_own_clear_error(tmp_path):
    ok = job(tmp_path, "ok", SCRIPT, ["--out", "made.txt", "--n", "3"])
    raises = job(tmp_path, "raises", "raise ValueError('no haystack fits')\n")
    exits = job(tmp_path, "exits", "import sys\nsys.exit('tokenizer not found')\n")
    loops = job(tmp_path, "loops", "while True:\n    pass\n", timeout=1)  # stopped by its CPU limit
    sleeps = job(tmp_path, "sleeps", "import time\ntime.sleep(600)\n", timeout=0.2)  # hung: idle
    after = job(tmp_path, "after", SCRIPT, ["--out", "made.txt"])
    results = launch([ok, raises, exits, loops, sleeps, after])

    assert results[0] == {"returncode": 0, "timed_out": False}
    made = (Path(ok["cwd"]) / "made.txt").read_text()
    assert made == f"sibling ['--out', 'made.txt', '--n', '3'] {ok['cwd']}"
    assert Path(ok["stdout"]).read_text() == "to stdout\n"
    assert results[1]["returncode"] == 1
    assert "ValueError: no haystack fits" in Path(raises["stderr"]).read_text()
    assert results[2]["returncode"] == 1
    assert Path(exits["stderr"]).read_text().strip() == "tokenizer not found"
    assert results[3] == {"returncode": None, "timed_out": True}
    assert results[4] == {"returncode": None, "timed_out": True}
    assert results[5] == {"returncode": 0, "timed_out": False}  # one slow job stops no other

    if importlib.util.find_spec("long_context_eval") is None:
        return  # the task names below come from the speedkv[ruler] extra
    with pytest.raises(UserError, match="could not generate niah_single_1 .*no haystack fits"):
        ruler.generated_file("ruler/niah_single_1", 1024, raises, results[1])
    with pytest.raises(UserError, match="did not finish within 1 s of CPU time at length 1024"):
        ruler.generated_file("ruler/niah_single_1", 1024, loops, results[3])
