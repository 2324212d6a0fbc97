"""Every command and Python snippet in README.md runs as written, on the embedded model, with
small sizes appended (click takes the last value of an option given twice), from a directory
where a new user would stand: a `doc.txt` to ask about and the shipped `adapters/`. Each
command is a process of its own; most are forked from one that has imported torch and
transformers already (preloaded_cli.py), and `--version`, `--help` and `serve` start as a
shell starts them.

`make demo` and `make test` are the two README lines not run here: this suite is `make test`,
and `make demo` runs in a fresh clone before a release."""

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import free_port, stop_server, wait_until_healthy
from preloaded_cli import PreloadedCli

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
SPEEDKV = str(Path(sys.executable).parent / "speedkv")

# what each command gets appended so that it runs in seconds
SMALL = {
    "generate": ["--max-new-tokens", "4"],
    "bench": ["--lengths", "256", "--max-new-tokens", "4", "--repeats", "1"],
    "bench-reuse": ["--lengths", "256", "--repeats", "1", "--questions", "1"],
    "demo": ["--prompt-tokens", "300", "--max-new-tokens", "4"],
    "eval": [
        "--lengths",
        "512",
        "--samples",
        "1",
        "--depths",
        "0.5",
        "--continuation-tokens",
        "16",
    ],
    "diagnose": ["--samples", "2", "--doc-tokens", "32", "--max-new-tokens", "4"],
    "choose-lcut": ["--samples", "1", "--prompt-tokens", "96", "--continuation-tokens", "8"],
    "calibrate-tsp": ["--samples", "1", "--prompt-tokens", "128"],
    "train": ["--steps", "2", "--seq-len", "512", "--data", "builtin:instruct=0"],
}

pytestmark = pytest.mark.real_model


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


# the environments whose `speedkv` the README runs: .venv-vllm's lines run in the vLLM tests
VENVS = (".venv", ".venv-vllm")


def readme_commands(venv: str = ".venv") -> list[list[str]]:
    """The arguments of every `VENV/bin/speedkv` line of the README's bash blocks."""
    found = []
    for block in code_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] == f"{venv}/bin/speedkv":
                found.append(words[1:])
            else:
                tested = [f"{v}/bin/speedkv" for v in VENVS] + ["make"]
                assert not words or words[0] in tested, f"a README command not tested: {line}"
    return found


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory) -> Path:
    """A working directory with a document and the shipped adapters."""
    home = tmp_path_factory.mktemp("newcomer")
    (home / "adapters").symlink_to(ROOT / "adapters")
    from speedkv.prompts.haystack import essays

    text = " ".join(list(essays().values())[:2])[:3000]  # about 630 tokens
    (home / "doc.txt").write_text(f"{text}\n\nWhat is the main point of the text above?\n")
    return home


ONE_THREAD = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def run(
    args: list[str], cwd: Path, threads: int | None = None, cli: PreloadedCli | None = None
) -> subprocess.CompletedProcess:
    """`speedkv ARGS`, a process of its own: forked from `cli`'s preloaded one (whose threads
    it has) if given, else started as a shell starts it."""
    if cli:
        done = cli.run(args, cwd, timeout=900)
    else:
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        done = subprocess.run(
            [SPEEDKV, *args], cwd=cwd, capture_output=True, text=True, timeout=900, env=env
        )
    assert done.returncode == 0, f"speedkv {shlex.join(args)}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr
    return done


def serve_and_ask(args: list[str], cwd: Path) -> dict:
    """Start the server as written (on a free port), ask it one chat question, stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen([SPEEDKV, *args, "--port", str(port)], cwd=cwd,
                                  stdout=subprocess.DEVNULL, stderr=log, text=True)  # fmt: skip
        try:
            wait_until_healthy(server, url, log)
            with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as models:
                served = json.loads(models.read())["data"][0]["id"]
            body = json.dumps(
                {
                    "model": served,
                    "messages": [{"role": "user", "content": "Name a river."}],
                    "max_tokens": 4,
                }
            ).encode()
            request = urllib.request.Request(
                f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=300) as answer:
                return json.loads(answer.read())
        finally:
            stop_server(server)


def test_readme_lists_the_commands_it_shows():
    names = {args[0] for args in readme_commands() if not args[0].startswith("-")}
    assert {"generate", "bench", "demo", "eval", "diagnose", "choose-lcut", "train"} <= names


def files_of(args: list[str]) -> set[str]:
    """What a command writes or reads that another may share: a run's folder, a saved cache."""
    return {"/".join(a.split("/")[:2]) for a in args if a.startswith("runs/")} | {
        a for a in args if a.endswith(".kv")
    }


def chains(commands: list[list[str]]) -> list[list[list[str]]]:
    """The commands in groups that must each run in order: commands that share a run's folder
    or a saved cache go in one group, in the README's order."""
    groups: list[tuple[set[str], list[list[str]]]] = []
    for args in commands:
        files = files_of(args)
        sharing = [g for g in groups if g[0] & files]
        members = sorted([args, *(a for g in sharing for a in g[1])], key=commands.index)
        groups = [g for g in groups if g not in sharing]
        groups.append((files.union(*(g[0] for g in sharing)), members))
    return [commands for _, commands in groups]


def test_readme_command_chains_keep_each_writer_before_its_reader():
    grouped = chains(readme_commands())
    assert sum(map(len, grouped)) == len(readme_commands())
    for first, then in [("--save", "--load"), ("runs/eval", "eval-report"),
                        ("runs/train/speed22", "train-compare")]:  # fmt: skip
        (chain,) = [c for c in grouped if any(first in args for args in c)]
        order = [i for i, args in enumerate(chain) if first in args or then in args]
        assert len(order) >= 2 and first in chain[order[0]]


# the commands that start as a shell starts them; the others are forked from a process that has
# imported torch and transformers already (preloaded_cli.py), which saves most of their time
FROM_THE_SHELL = {"--version", "--help", "serve"}


def test_every_readme_command_runs(newcomer):
    cli = PreloadedCli(SPEEDKV, ONE_THREAD)

    def run_chain(chain: list[list[str]]) -> list[str]:
        ran = []
        for args in chain:
            command = args[0]
            if command == "serve":
                reply = serve_and_ask(args, newcomer)
                assert reply["choices"][0]["message"]["content"]
                assert reply["speedkv"][0]["method"].startswith("speed:lcut=22,anchors=bos,deep=1")
            else:
                forked = None if command in FROM_THE_SHELL else cli
                done = run(args + SMALL.get(command, []), newcomer, threads=1, cli=forked)
                if "--json" in args:
                    assert json.loads(done.stdout)["method"]
                if command == "--version":
                    assert re.fullmatch(r"speedkv \d+\.\d+\.\d+\n", done.stdout)
            ran.append(command)
        return ran

    # two chains at a time, one thread each (most of a command's time is starting Python), the
    # longest chains first. `doctor` runs before them, alone: the first process that needs the
    # kernel choice for one thread times the kernels and stores it for every later one, and
    # that must not be timed beside another command
    grouped = sorted(chains(readme_commands()), key=len, reverse=True)
    (doctor,) = [chain for chain in grouped if chain[0][0] == "doctor"]
    ran = run_chain(doctor)
    with ThreadPoolExecutor(max_workers=2) as pool:
        rest = [chain for chain in grouped if chain is not doctor]
        ran += [c for chain in pool.map(run_chain, rest) for c in chain]
    assert (newcomer / "runs" / "train" / "speed22" / "adapter_model.safetensors").is_file()
    assert (newcomer / "runs" / "probes.png").is_file()
    assert "serve" in ran and "train-compare" in ran


def test_every_readme_python_snippet_runs(newcomer, monkeypatch, capsys):
    from speedkv.hf.loading import load_model

    checkpoint = load_model("smollm2-135m", dtype="float32", progress=False).source
    monkeypatch.chdir(newcomer)
    snippets = code_blocks("python")
    assert len(snippets) == 2
    for snippet in snippets:
        code = snippet.replace("path/to/a/llama-or-qwen-checkpoint", checkpoint)
        scope: dict = {}
        exec(compile(code, "README.md", "exec"), scope)  # noqa: S102  (the README's own code)
        assert scope["result"].text.strip()
    assert capsys.readouterr().out.strip()
