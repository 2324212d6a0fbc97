"""The model options (--model, --adapter, --dtype, ...) are declared once, in cli/options.py's
MODEL_OPTIONS, and `model_options` gives each command the ones it names: every such command's
--help lists them with the table's help text, and no command declares them by hand."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Annotated, Any, get_args

import pytest
import typer
from typer.testing import CliRunner

from speedkv.cli.app import app
from speedkv.cli.common import ModelArgs
from speedkv.cli.options import MODEL_HELP, MODEL_OPTIONS, AsJson, model_options

BOX = re.compile(r"[│╭╮╰╯─]")


def leaf_commands() -> Iterator[tuple[list[str], Any]]:
    """Every command of `speedkv`, as its words on the command line and its click command
    (typer's own copy of click: groups are known by their `commands`)."""

    def walk(command: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
        if getattr(command, "commands", None):
            for name, sub in command.commands.items():
                yield from walk(sub, [*path, name])
        else:
            yield path, command

    yield from walk(typer.main.get_command(app), [])


def model_commands() -> list[tuple[list[str], Any, tuple[str, ...]]]:
    """The commands `model_options` made, with the option names each took (typer's callback
    wraps the decorated function and keeps its attributes)."""
    found = []
    for path, command in leaf_commands():
        names = getattr(command.callback, "model_options", None)
        if names is not None:
            found.append((path, command, names))
    return found


def option_info(name: str) -> typer.models.OptionInfo:
    return get_args(MODEL_OPTIONS[name].alias)[1]


def flat(text: str) -> str:
    """Help text as words: no table borders, no line wrapping; the help is rendered as
    markdown, which drops the backticks."""
    return " ".join(BOX.sub(" ", text).replace("`", "").split())


MODEL_COMMANDS = model_commands()


def test_the_model_loading_commands_take_the_shared_options():
    assert {" ".join(path) for path, _, _ in MODEL_COMMANDS} >= {"generate", "serve", "train"}


@pytest.mark.parametrize(
    "path, command, names", MODEL_COMMANDS, ids=[" ".join(p) for p, _, _ in MODEL_COMMANDS]
)
def test_help_lists_the_shared_options_with_their_help(path, command, names):
    params = {param.name: param for param in command.params}
    for name in MODEL_OPTIONS:
        if name not in names:  # e.g. train has no --prepack
            assert name not in params, f"{path} has a --{name} of its own"
            continue
        info = option_info(name)
        assert params[name].help == info.help
        assert params[name].default == MODEL_OPTIONS[name].default
    shown = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "120"})
    assert shown.exit_code == 0, shown.output
    for name in names:
        param = params[name]
        for flag in (*param.opts, *param.secondary_opts):
            assert re.search(rf"(^|\s){re.escape(flag)}(\s|$)", shown.output), (path, flag)
        assert flat(option_info(name).help) in flat(shown.output), (path, name)


def test_no_command_declares_the_model_options_by_hand():
    # a command that lists --model itself would not be in MODEL_COMMANDS, nor checked above
    by_hand = [
        " ".join(path)
        for path, command in leaf_commands()
        if any(param.help == MODEL_HELP for param in command.params)
        and getattr(command.callback, "model_options", None) is None
    ]
    assert by_hand == []


def toy_app(**before: str | None) -> tuple[typer.Typer, list[ModelArgs]]:
    """One command that takes --model, --dtype, --threads and --backend and keeps what it got."""
    got: list[ModelArgs] = []
    toy = typer.Typer(add_completion=False)

    @toy.command()
    @model_options("dtype", "threads", "backend", before=before)
    def run(
        *,
        model: ModelArgs,
        first: Annotated[int, typer.Option("--first")] = 1,
        last: Annotated[int, typer.Option("--last")] = 2,
        as_json: AsJson = False,
    ) -> None:
        got.append(model)

    return toy, got


def test_the_command_gets_one_model_args():
    toy, got = toy_app()
    done = CliRunner().invoke(toy, ["-m", "x", "--dtype", "float32", "--threads", "2"])
    assert done.exit_code == 0, done.output
    (args,) = got
    assert (args.options.model, args.options.dtype, args.threads) == ("x", "float32", 2)
    assert args.backend == "speedkv" and args.vllm_args == []
    # what the command does not take keeps the builder's default: no prepacking here
    assert args.options.prepack is False and args.options.adapter is None


def param_names(toy: typer.Typer) -> list[str]:
    return [param.name for param in typer.main.get_command(toy).params]


def test_options_go_where_the_command_puts_them():
    # --help lists options in this order
    plain = ["model", "first", "last", "dtype", "threads", "backend", "as_json"]
    assert param_names(toy_app()[0]) == plain
    moved = ["model", "first", "dtype", "threads", "last", "as_json", "backend"]
    assert param_names(toy_app(dtype="last", backend=None)[0]) == moved


def test_mistakes_in_declaring_a_command_fail_at_import():
    with pytest.raises(ValueError, match="not model options"):
        model_options("dtypes")
    with pytest.raises(ValueError, match="does not take"):
        model_options("dtype", before={"device": None})

    def no_model(*, threads: int = 0) -> None: ...

    with pytest.raises(TypeError, match="model: ModelArgs"):
        model_options("dtype")(no_model)
    with pytest.raises(TypeError, match="no parameter 'nowhere'"):
        toy_app(dtype="nowhere")
