"""A fuzz of the command line: every option of every command, taken from the click commands
the Typer app builds, gets odd values and odd files. Whatever it is given, the CLI ends with
exit 0 or 2, never a traceback, and an error is one line "error: ...".

No model loads: loading (or timing the kernels, `tune`'s work) raises `ModelLoadReached`, which
means every check made before loading passed (they are the ones that can see arguments and
files; a model is never needed to reject them). Examples are derandomized, so a run is
reproducible and bounded in time."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest
import torch
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speedkv.cli import app as cli
from speedkv.core.engine import Engine
from speedkv.core.prefix_file import save_prefix

from conftest import tiny_model

APP = typer.main.get_command(cli.app)  # what `cli.app(...)` builds on every call, built once
COMMANDS = APP.commands
ODD_TEXT = [
    "", " ", "0", "-1", "1", "2", "3", "16", "1e3", "0.5", "-0.5", "nan", "inf", "1,2", "x",
    "9" * 40, str(2**31), str(2**64), str(-(2**63) - 1), ";", ",", ":", "=", "..", "--", "-n",
    "full", "full;", ";;", "hf", "speed", "speed:", "speed:lcut", "speed:lcut=", "speed:lcut=2",
    "speed:lcut=-1", "speed:lcut=99999999999999999999", "speed:lcut=2,lcut=3",
    "speed:lcut=2,anchors=sink:0", "speed:lcut=2,deep=header", "nosuch:x=1", "snapkv:retain=0",
    "pop:lcut=2", "builtin", "builtin:nosuch=1", "builtin:needle=-1", "auto", "cpu", "cuda",
    "cuda:7", "meta", "float32", "bfloat16", "float8", "bos", "none", "sink:4", "sink:x",
    "niah=0", "niah=1,fidelity=x", "bogus=1", "0..3", "3..0", "agreement=2", "kl=x", "step",
    "minutes", "é", "日本語", "\u202e", "\U0001f600",
]  # fmt: skip
# Control characters and lone surrogates are left out: a shell cannot pass NUL, and stderr
# would show the others escaped, which the test's own capture cannot.
PRINTABLE = st.characters(exclude_categories=("Cc", "Cs"))
ODD_FILES = (
    "binary", "latin1", "nul", "empty", "blank", "huge", "unreadable", "directory",
    "dangling", "missing", "junk_run", "prefix.kv",
)  # fmt: skip


class ModelLoadReached(Exception):
    """The command got as far as loading a model (or installing one): its checks passed."""


def reached(*_args, **_kwargs):
    raise ModelLoadReached


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> Path:
    """A working directory holding one odd file of each kind (named as in ODD_FILES)."""
    root = tmp_path_factory.mktemp("fuzz")
    garbage = bytes(range(256)) * 4
    (root / "binary").write_bytes(garbage)
    (root / "latin1").write_bytes("café au lait\nnaïve\n".encode("latin-1"))
    (root / "nul").write_bytes(b"hello\x00world\n")
    (root / "empty").write_bytes(b"")
    (root / "blank").write_bytes(b"\n   \n\t\n")
    (root / "huge").write_bytes(b"word " * 400_000)
    (root / "unreadable").write_text("secret\n")
    (root / "unreadable").chmod(0)  # root reads it anyway: the directory and link cover that
    (root / "directory").mkdir()
    (root / "dangling").symlink_to(root / "nowhere")
    junk = root / "junk_run"  # what an adapter, an eval or a training run holds, all garbage
    junk.mkdir()
    for name in ("adapter_config.json", "training.json", "results.json", "run.json"):
        (junk / name).write_bytes(garbage)
    # a whole prefix file (of a tiny model), so that --load gets past its own checks
    engine = Engine(tiny_model("llama"))
    save_prefix(
        engine.prefill(list(range(1, 20)), "speed:lcut=2,deep=1"), root / "prefix.kv", engine
    )
    return root


def invoke(args: list[str], place: Path) -> tuple[int, str]:
    """Run `speedkv ARGS` in this process, in `place`, with nothing on stdin; return the exit
    code (0 when the model would have loaded) and stderr."""
    err = io.StringIO()
    code = 0
    threads = torch.get_num_threads()  # --threads and --seed must not leak into later tests
    with pytest.MonkeyPatch.context() as patch, torch.random.fork_rng():
        patch.setattr("speedkv.hf.loading.load_model", reached)
        patch.setattr("speedkv.hf.loading.install_embedded", reached)
        patch.setattr("speedkv.kernels.tuning.measure", reached)  # timing kernels is the work too
        patch.setattr(cli, "app", APP.main)  # as built per call; building is most of a run
        patch.setattr(sys, "argv", ["speedkv", *args])
        patch.setattr(sys, "stdin", io.StringIO(""))
        patch.chdir(place)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                cli.main()
            except SystemExit as stop:
                code = stop.code or 0
            except ModelLoadReached:
                pass
    torch.set_num_threads(threads)
    return code, err.getvalue()


def check(args: list[str], place: Path) -> None:
    code, err = invoke(args, place)
    assert "Traceback" not in err, (args, err)
    assert code in (0, 2), (args, code, err)
    if code == 2:
        said = [line for line in err.splitlines() if line.strip() and not line.startswith("[")]
        assert len(said) == 1 and said[0].startswith("error: "), (args, err)


def takes_value(param) -> bool:
    return not getattr(param, "is_flag", False)


def required_args(command, place: Path, supplied=()) -> list[str]:
    """Harmless values for the required parameters not `supplied`: a fresh directory."""
    args = []
    for param in command.params:
        if param.required and param not in supplied:
            value = str(place / "fresh")
            args += [value] if param.param_type_name == "argument" else [param.opts[0], value]
    return args


def given_as(param, value: str) -> list[str]:
    return [value] if param.param_type_name == "argument" else [param.opts[0], value]


PARAMS = [
    pytest.param(name, param.name, id=f"{name}:{param.name}")
    for name, command in sorted(COMMANDS.items())
    for param in command.params
    if takes_value(param)
]


@pytest.mark.parametrize("name, param_name", PARAMS)
def test_every_parameter_refuses_odd_files_in_one_sentence(name, param_name, place):
    """Each parameter that takes a value, given each odd file in turn (a file option reads it;
    any other sees an odd string)."""
    command = COMMANDS[name]
    param = next(p for p in command.params if p.name == param_name)
    for odd in ODD_FILES:
        args = [name, *given_as(param, str(place / odd)), *required_args(command, place, [param])]
        check(args, place)


def odd_value(place: Path) -> st.SearchStrategy[str]:
    return st.one_of(
        st.sampled_from(ODD_TEXT),
        st.integers(-(2**70), 2**70).map(str),
        st.floats().map(str),
        st.text(PRINTABLE, max_size=12),
        st.sampled_from(ODD_FILES).map(lambda name: str(place / name)),
    )


# a group (`speedkv leaderboard`) has no options of its own to fuzz; its commands run a board's
# sweeps for hours or redraw the published boards, which a fuzz must not start
@pytest.mark.parametrize("name", sorted(name for name, c in COMMANDS.items() if c.params))
def test_odd_values_end_in_exit_0_or_2_without_a_traceback(name, place):
    """Several parameters of one command at a time, with odd values and flags."""
    command = COMMANDS[name]

    @settings(
        max_examples=100,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def run(data):
        args = [name]
        chosen = data.draw(st.lists(st.sampled_from(command.params), max_size=4, unique=True))
        for param in chosen:
            if takes_value(param):
                args += given_as(param, data.draw(odd_value(place)))
            else:
                args.append(data.draw(st.sampled_from([*param.opts, *param.secondary_opts])))
        check([*args, *required_args(command, place, chosen)], place)

    run()
