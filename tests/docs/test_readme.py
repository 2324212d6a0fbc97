"""Every command and Python snippet in README.md, docs/usage.md and docs/install.md (the pages
the README sends readers to for every other command and for installing) runs as written, on
the embedded model, with small sizes appended (click takes the last value of an option given
twice), from a directory where a new user would stand: a `doc.txt` to ask about and the
shipped `adapters/`. Each distinct command is a process of its own; most are forked from one
that has imported torch and transformers already (preloaded_cli.py), and `--version`, `--help`
and `serve` start as a shell starts them. The OpenAI-client snippet runs against the README's
own `serve` command.

`make demo`, `make test` and `make test-fast` are the lines not run here: this suite is `make
test` (`make test-fast` is its tests/unit tier), and `make demo` runs in a fresh clone before a
release. The `pip install` lines are held to what
`make install` installs, which every `make test` runs first
(test_readme_pip_lines_install_what_make_install_does)."""

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from helpers import free_port, stop_server, wait_until_healthy
from preloaded_cli import PreloadedCli

ROOT = Path(__file__).resolve().parents[2]
# the pages whose commands run here: the README, and the pages it sends readers to for every
# other command and for installing
PAGES = {
    name: (ROOT / name).read_text() for name in ("README.md", "docs/usage.md", "docs/install.md")
}
README = PAGES["README.md"]
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


def code_blocks(language: str, pages: tuple[str, ...] = tuple(PAGES)) -> list[str]:
    return [
        block
        for page in pages
        for block in re.findall(rf"```{language}\n(.*?)```", PAGES[page], re.S)
    ]


# the environments whose `speedkv` the pages run: .venv-vllm's lines run in the vLLM tests;
# `make demo`, `make test` and `make test-fast` are the suite's own, and `pip` lines are held to
# `make install`
VENVS = (".venv", ".venv-vllm")
TESTED = [f"{v}/bin/speedkv" for v in VENVS] + ["make", "pip"]


def command_lines() -> list[list[str]]:
    """The words of every command line of the pages' bash blocks (continuations joined)."""
    found = []
    for block in code_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            assert not words or words[0] in TESTED, f"a command not tested: {line}"
            assert words[:1] != ["make"] or words[1:] in (["demo"], ["test"], ["test-fast"]), line
            if words:
                found.append(words)
    return found


def readme_commands(venv: str = ".venv") -> list[list[str]]:
    """The arguments of every distinct `VENV/bin/speedkv` line of the pages' bash blocks, in
    the pages' order (a command shown twice runs once)."""
    found: list[list[str]] = []
    for words in command_lines():
        if words[0] == f"{venv}/bin/speedkv" and words[1:] not in found:
            found.append(words[1:])
    return found


def small(args: list[str]) -> list[str]:
    """What a command gets appended so that it runs in seconds: RULER's tasks need prompts of
    their least length (1024 tokens for the synthetic ones), the rest run at 512."""
    extra = SMALL.get(args[0], [])
    if args[0] == "eval" and "--tasks" in args:
        tasks = args[args.index("--tasks") + 1].split(",")
        if any(t.startswith("ruler") for t in tasks):
            from speedkv.evals import ruler

            named = [t for t in tasks if t.startswith("ruler/")]
            least = max(map(ruler.min_length, named if "ruler" not in tasks else ruler.TASKS))
            extra = [*extra, "--lengths", str(least)]
    return extra


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


@contextmanager
def served(args: list[str], cwd: Path) -> Iterator[str]:
    """The server started as written (on a free port) for the time of the block: its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen([SPEEDKV, *args, "--port", str(port)], cwd=cwd,
                                  stdout=subprocess.DEVNULL, stderr=log, text=True)  # fmt: skip
        try:
            wait_until_healthy(server, url, log)
            yield url
        finally:
            stop_server(server)


def serve_and_ask(args: list[str], cwd: Path) -> dict:
    """Start the server as written (on a free port), ask it one chat question, stop it."""
    with served(args, cwd) as url:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as models:
            served_model = json.loads(models.read())["data"][0]["id"]
        body = json.dumps(
            {
                "model": served_model,
                "messages": [{"role": "user", "content": "Name a river."}],
                "max_tokens": 4,
            }
        ).encode()
        request = urllib.request.Request(
            f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as answer:
            return json.loads(answer.read())


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
                        ("runs/train/speed22-lora", "train-compare")]:  # fmt: skip
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
                done = run(args + small(args), newcomer, threads=1, cli=forked)
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
    clients = [snippet for snippet in snippets if "from openai import" in snippet]
    assert len(snippets) == 3 and len(clients) == 1
    for snippet in snippets:
        if snippet in clients:
            continue
        code = snippet.replace("path/to/a/llama-or-qwen-checkpoint", checkpoint)
        scope: dict = {}
        exec(compile(code, "README.md", "exec"), scope)  # noqa: S102  (the README's own code)
        assert scope["result"].text.strip()
    assert capsys.readouterr().out.strip()
    # the OpenAI client, against the README's own `serve` command
    (serve,) = [args for args in readme_commands() if args[0] == "serve"]
    assert f"speedkv {shlex.join(serve)}" in README
    with served(serve, newcomer) as url:
        (client,) = clients
        code = client.replace("http://127.0.0.1:8000", url)
        assert code != client, "the client snippet no longer names the server's default address"
        scope = {}
        exec(compile(code, "README.md", "exec"), scope)  # noqa: S102  (the README's own code)
    assert scope["reply"].choices[0].message.content.strip()


def make_install_arguments() -> list[list[str]]:
    """The arguments `make install` hands the installer (tools/venv_install.py), line by line."""
    makefile = (ROOT / "Makefile").read_text()
    return [
        shlex.split(line.split("$(INSTALL) $(VENV)", 1)[1])
        for line in makefile.splitlines()
        if "$(INSTALL) $(VENV)" in line
    ]


def test_readme_pip_lines_install_what_make_install_does():
    """`pip install` lines in the README, for an environment of one's own, install what `make
    install` does (which every `make test` runs): the project with extras `make install` gives
    it, and the same pinned packages, with `--no-deps` where it uses it."""
    pip_lines = [words for words in command_lines() if words[0] == "pip"]
    assert pip_lines, "the README shows no pip install"
    made = make_install_arguments()
    project_extras = {
        extra
        for args in made
        for arg in args
        if arg.startswith(".[")
        for extra in arg[2:-1].split(",")
    }
    for words in pip_lines:
        assert words[1] == "install", words
        args = words[2:]
        if "-e" in args:
            (target,) = [a for a in args if a != "-e"]
            assert target == "." or target.startswith(".["), words
            extras = set(target[2:-1].split(",")) if target.startswith(".[") else set()
            assert extras <= project_extras, f"{words}: make install gives {project_extras}"
        else:
            assert args in made, f"{shlex.join(words)} is not what make install runs: {made}"
