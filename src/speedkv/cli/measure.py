"""`speedkv measure NAME [ARGS]...`: one of the measurements behind benchmarks/'s figures
(speedkv.bench.measure), with every argument after NAME passed to its own argparse options."""

from __future__ import annotations

import shutil
import textwrap
from typing import Annotated

import typer

from speedkv.bench.measure import MEASUREMENTS, load_main, summary

commands = typer.Typer()
# typer parses nothing after NAME: options and --help go to the measurement's own parser
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}
HELP_WORDS = ("--help", "-h")


def listing() -> str:
    """The usage line and every measurement with its one-line summary."""
    width = max(map(len, MEASUREMENTS))
    columns = min(100, shutil.get_terminal_size().columns)
    lines = [
        "Usage: speedkv measure NAME [ARGS]...",
        "",
        "Run one measurement; `speedkv measure NAME --help` lists its options.",
        "",
        "Measurements:",
    ]
    for name in MEASUREMENTS:  # each summary wrapped under its own column
        lines.append(textwrap.fill(summary(name), columns, initial_indent=f"  {name:<{width}}  ",
                                   subsequent_indent=" " * (width + 4)))  # fmt: skip
    return "\n".join(lines)


@commands.command(context_settings=PASS_THROUGH)
def measure(
    ctx: typer.Context,
    name: Annotated[
        str | None, typer.Argument(help="The measurement; none lists them.", show_default=False)
    ] = None,
) -> None:
    """Run a measurement behind benchmarks/'s figures (decode and prefill kernels, turn-about
    engine runs, server load tests, paired RULER gaps); `speedkv measure` lists them,
    `speedkv measure NAME --help` gives one's options."""
    if name is None or name in HELP_WORDS:
        print(listing())
        return
    load_main(name)(list(ctx.args))
