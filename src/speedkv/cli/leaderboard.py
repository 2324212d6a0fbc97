"""`speedkv leaderboard run` and `speedkv leaderboard render`: the RULER leaderboard's sweeps
and its boards (benchmarks/ruler/MODEL-LENGTH/, benchmarks/ruler-served/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from speedkv.errors import UserError

commands = typer.Typer()
board = typer.Typer(
    name="leaderboard",
    help="The RULER leaderboard: speedkv's methods and kvpress's presses on the same RULER "
    "samples (`run`), and its published boards redrawn from what they archive (`render`).",
)
commands.add_typer(board)


@board.callback(invoke_without_command=True)
def _board(ctx: typer.Context) -> None:
    # `speedkv leaderboard` alone lists its commands, as --help does
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())
        raise typer.Exit()


BoardModel = Annotated[
    str | None,
    typer.Option(
        "--model", "-m", help="The board's model: smollm2-135m or qwen2.5-coder-0.5b (a plan "
        "per model and length; with --length)."
    ),
]  # fmt: skip
BoardLength = Annotated[
    int | None,
    typer.Option("--length", help="The board's RULER length, prompt and answer (4096, 8064 or "
                 "16384, as planned)."),
]  # fmt: skip
Work = Annotated[
    Path,
    typer.Option("--work", help="Where the sweeps' parts are run: WORK/MODEL/LENGTH/SWEEP-KofN."),
]
Out = Annotated[
    Path | None,
    typer.Option("--out", help="The board's folder (default benchmarks/ruler/MODEL-LENGTH)."),
]
Docs = Annotated[
    Path | None,
    typer.Option("--docs", help="Also refresh this page's fenced copy of the board's tables "
                 "(docs/ruler.md)."),
]  # fmt: skip
KvpressPython = Annotated[
    str,
    typer.Option("--kvpress-python", help="The kvpress environment's Python (make kvpress-venv): "
                 "runs the kvpress sweeps, and rewrites a kvpress part's records."),
]  # fmt: skip
SERVED = Path("benchmarks/ruler-served")


@board.command("run")
def run_command(
    sweeps: Annotated[
        str,
        typer.Argument(
            help="Sweeps, comma-separated: base, adapter, agnostic, kvpress, kvzip, ttft, or "
            "all (a plan without query-agnostic rows or KVzip has no such sweep). None: only "
            "--archive, or the board."
        ),
    ] = "",
    model: BoardModel = "smollm2-135m",
    length: BoardLength = 4096,
    samples: Annotated[
        int | None,
        typer.Option(
            help="Samples per task, for every sweep (default: the plan's; KVzip's may be fewer)."
        ),
    ] = None,  # fmt: skip
    presses: Annotated[
        str | None,
        typer.Option(help="kvpress's presses, comma-separated (default: the plan's)."),
    ] = None,
    jobs: Annotated[
        int, typer.Option(min=1, help="Parallel processes per sweep: its tasks in JOBS groups.")
    ] = 2,
    lanes: Annotated[
        str,
        typer.Option(
            help="Run only these lanes (task groups), comma-separated, 1 to --jobs (default: all)."
        ),
    ] = "",  # fmt: skip
    kvpress_python: KvpressPython = ".venv-kvpress/bin/python",
    work: Work = Path("runs/ruler-leaderboard"),
    out: Out = None,
    render: Annotated[
        bool, typer.Option("--render", help="Write the board after the sweeps.")
    ] = False,
    archive: Annotated[
        bool,
        typer.Option(
            "--archive",
            help="Store every part's answers so far in the board's "
            "answers/ (gzip): a sweep run later on another machine resumes from them.",
        ),
    ] = False,  # fmt: skip
    docs: Docs = None,
) -> None:
    """Run a board's sweeps, each resumable, their task groups in --jobs lanes side by side
    (a lane goes on to its group of the next sweep as soon as its own is done); `ttft` runs
    alone, after them. A board is a plan: --model and --length pick it (the 4K SmolLM2 board has
    every row; the others check the main ones). Sweeps take hours: --archive keeps their
    answers beside the board, so a sweep can go on on another machine."""
    from speedkv.leaderboard.run import Options, run

    if model is None or length is None:
        raise UserError("name the board with --model and --length")
    run(Options(model=model, length=length, samples=samples, presses=presses, run=sweeps,
                jobs=jobs, lanes=lanes, kvpress_python=kvpress_python, work=work, out=out,
                render=render, archive=archive, docs=docs))  # fmt: skip


@board.command("render")
def render_command(
    model: BoardModel = None,
    length: BoardLength = None,
    work: Work = Path("runs/ruler-leaderboard"),
    out: Out = None,
    docs: Docs = None,
    kvpress_python: KvpressPython = ".venv-kvpress/bin/python",
) -> None:
    """Redraw the published boards: leaderboard.md, results.json and pareto.png of each planned
    board (or the one --model and --length name), from the runs under --work, each part
    archived beside the board restored first where --work lacks it, and the published rows of
    sweeps with neither; and the served board's table.md from its results.json. Nothing is
    measured."""
    from speedkv.leaderboard.plans import PLANS
    from speedkv.leaderboard.run import Options, run
    from speedkv.leaderboard.served import served_page

    if (model is None) != (length is None):
        raise UserError("name one board with both --model and --length, or neither for all")
    boards = list(PLANS) if model is None else [(model, length)]
    if out is not None and len(boards) > 1:
        raise UserError("--out names one board's folder: give --model and --length too")
    for name, size in boards:
        run(Options(model=name, length=size, kvpress_python=kvpress_python, work=work, out=out,
                    docs=docs))  # fmt: skip
    served = SERVED / "results.json"
    if model is None and served.is_file():
        (SERVED / "table.md").write_text(served_page(json.loads(served.read_text())))
        print(SERVED / "table.md")
