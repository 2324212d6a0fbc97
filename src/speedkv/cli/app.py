"""`speedkv ...`: the command line. Each module of this package owns a group of commands
(`commands`, a Typer app); this one merges them and turns user mistakes into one sentence."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from speedkv.cli import (
    analysis,
    bench,
    demo,
    evals,
    generate,
    leaderboard,
    machine,
    measure,
    prefix,
    serve,
    train,
)
from speedkv.errors import Unsupported, UserError
from speedkv.version import __version__

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # docstrings wrap as paragraphs, not at their line breaks
)
for group in (generate, prefix, demo, bench, evals, leaderboard, analysis, train, serve, machine,
              measure):  # fmt: skip
    app.add_typer(group.commands)


def _print_version(value: bool) -> None:
    if value:
        print(f"speedkv {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """SPEED (Shallow Prefill, dEEp Decode) and peer KV-cache methods for long-context
    inference. Method specs look like 'full' or 'speed:lcut=22,anchors=bos'.

    `speedkv COMMAND --help` lists a command's options."""


def main() -> None:
    """Entry point: user mistakes print one sentence and exit 2, never a traceback."""
    try:
        app(standalone_mode=False)
    except (UserError, Unsupported) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except typer.TyperException as err:  # usage mistakes found by the argument parser
        message = err.format_message() if hasattr(err, "format_message") else str(err)
        if message:  # empty when the parser already printed the help
            print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
