"""`speedkv eval` and `speedkv eval-report`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import typer

from speedkv.cli.common import MODEL_HELP, check_adapter, load, set_threads
from speedkv.errors import UserError
from speedkv.log import log

commands = typer.Typer()


@commands.command("eval")
def eval_command(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help=MODEL_HELP),
    methods: str = typer.Option(
        "full;speed:lcut=22,anchors=bos",
        "--methods",
        help="Method specs separated by ';'. full is always added (the reference).",
    ),
    tasks: str = typer.Option(
        "niah,fidelity,sanity",
        "--tasks",
        help="Comma-separated: niah, niah_multikey, niah_multivalue, vt, fidelity, sanity.",
    ),
    lengths: str = typer.Option("2048", "--lengths", help="Prompt lengths in tokens."),
    n: str | None = typer.Option(
        None,
        "--n",
        help="Samples per task and length: one count, or per task 'niah=10,fidelity=4' "
        "(defaults: niah 10, niah_multikey 4, niah_multivalue 3, vt 3, fidelity 4, sanity 12).",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed for needles, depths, values, passages."),
    depths: str = typer.Option(
        "0.1,0.5,0.9", "--depths", help="Needle depths (0 = start, 1 = end of the document)."
    ),
    fidelity_tokens: int = typer.Option(
        64, "--fidelity-tokens", help="Tokens teacher-forced per fidelity sample."
    ),
    split: str = typer.Option(
        "eval", "--split", help="Essay split: eval (measuring) or calib (designing prompts)."
    ),
    dtype: str = typer.Option("auto", "--dtype", help="auto, float32 or bfloat16."),
    threads: int = typer.Option(
        0,
        "--threads",
        help="CPU threads for torch (0 = torch's default). On a CPU shared with other "
        "jobs, 1 is often several times faster.",
    ),
    out: Path = typer.Option(Path("runs/eval"), "--out", help="Directory for results."),
    resume: bool = typer.Option(
        False, "--resume", help="Keep the runs already in OUT/records.jsonl."
    ),
    adapter: Path | None = typer.Option(
        None,
        "--adapter",
        help="LoRA adapter from `speedkv train`, merged into the model for every method "
        "(the full reference included).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print results.json to stdout."),
) -> None:
    """Measure what methods cost in quality: needle retrieval, fidelity to full attention
    and short-prompt sanity, per prompt length."""
    from speedkv.cli.options import parse_lengths, parse_methods
    from speedkv.core.spec import split_spec
    from speedkv.evals.report import markdown_tables
    from speedkv.evals.runner import EvalConfig, EvalRunner
    from speedkv.evals.tasks import parse_depths, parse_n, parse_tasks

    task_list = parse_tasks(tasks)
    method_list = parse_methods(methods)
    for spec in method_list:
        split_spec(spec)  # malformed specs fail before the model loads
    if split not in ("eval", "calib"):
        raise UserError(f"split must be eval or calib, got '{split}'")
    config = EvalConfig(
        model=model,
        methods=method_list,
        tasks=task_list,
        lengths=parse_lengths(lengths),
        n=parse_n(n, task_list),
        seed=seed,
        dtype=dtype,
        depths=parse_depths(depths),
        fidelity_tokens=fidelity_tokens,
        split=split,
        adapter=str(adapter) if adapter is not None else None,
    )
    if fidelity_tokens < 1:
        raise UserError(f"fidelity-tokens must be at least 1, got {fidelity_tokens}")
    set_threads(threads)
    check_adapter(adapter)
    runner = EvalRunner(load(model, dtype, adapter=adapter), config, out)
    result = runner.run(resume=resume, log=log)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(markdown_tables(result))
        log(f"results in {out}/ (results.json, records.jsonl, tables.md, misses.md, plots)")


@commands.command("eval-report")
def eval_report_command(
    directory: Path = typer.Argument(..., help="A `speedkv eval --out` directory."),
    command: str | None = typer.Option(
        None, "--command", help="The command that regenerates it, quoted in the page."
    ),
    findings: Path | None = typer.Option(
        None,
        "--findings",
        help="A markdown file of what the numbers say, placed after the overview table.",
    ),
    page: Path | None = typer.Option(
        None,
        "--page",
        help="Write the page to this file instead of stdout, with its plots in a folder of "
        "the same name beside it (docs/results.md -> docs/results/).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Print the results page (markdown) of an evaluation: setup, method, every table."""
    from speedkv.evals.report import FIGURES, results_markdown

    path = directory / "results.json"
    if not path.is_file():
        raise UserError(f"'{path}' does not exist; run `speedkv eval --out {directory}` first")
    if findings is not None and not findings.is_file():
        raise UserError(f"findings file '{findings}' does not exist")
    if page is not None and page.suffix != ".md":
        raise UserError(f"--page must name a markdown file ending in .md, got '{page}'")
    result = json.loads(path.read_text())
    if as_json:
        print(json.dumps(result["summary"], indent=2))
        return
    notes = findings.read_text() if findings is not None else None
    if page is None:
        print(results_markdown(result, command, str(directory), notes), end="")
        return
    figures = page.with_suffix("")
    figures.mkdir(parents=True, exist_ok=True)
    shown = [name for name in FIGURES if (directory / name).is_file()]
    for name in shown:
        shutil.copyfile(directory / name, figures / name)
    links = [f"{figures.name}/{name}" for name in shown]
    text = results_markdown(result, command, str(directory), notes, links)
    page.write_text(text)
    log(f"wrote {page} and its plots in {figures}/")
