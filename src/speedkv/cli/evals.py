"""`speedkv eval` and `speedkv eval-report`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Annotated

import typer

from speedkv.cli.common import ModelArgs, read_text_file
from speedkv.cli.options import (
    AsJson,
    ContinuationTokens,
    Lengths,
    Methods,
    OutDir,
    Seed,
    model_options,
)
from speedkv.errors import UserError
from speedkv.log import log

commands = typer.Typer()


@commands.command("eval")
@model_options(
    "adapter", "dtype", "weights", "prepack", "device", "threads",
    before={"adapter": "reference", "dtype": "as_json"},
)  # fmt: skip
def eval_command(
    *,
    model: ModelArgs,
    methods: Methods = "full;speed",
    tasks: Annotated[
        str,
        typer.Option(
            "--tasks",
            help="Comma-separated: niah, niah_multikey, niah_multivalue, vt, fidelity, sanity, "
            "reuse (four facts asked over one cached document and with fresh prefills; "
            "docs/reuse.md), and ruler: RULER's 13 tasks (or one, e.g. ruler/niah_single_2, "
            "ruler/cwe, ruler/qa_1), generated and scored by NVIDIA's nvidia-long-context-eval "
            "(the speedkv[ruler] extra); a RULER length counts prompt and answer, as RULER's "
            "does (docs/ruler.md).",
        ),
    ] = "niah,fidelity,sanity",
    lengths: Lengths = "2048",
    samples: Annotated[
        str | None,
        typer.Option(
            "--samples",
            metavar="N|TASK=N,...",
            help="Samples per task and length: one count, or per task 'niah=10,fidelity=4' "
            "('ruler=20' sets every RULER task's; defaults: niah 10, niah_multikey 4, "
            "niah_multivalue 3, vt 3, fidelity 4, sanity 12, reuse 8 documents of 4 questions, "
            "each RULER task 20).",
        ),
    ] = None,
    seed: Seed = 0,
    depths: Annotated[
        str,
        typer.Option("--depths", help="Needle depths (0 = start, 1 = end of the document)."),
    ] = "0.1,0.5,0.9",
    continuation_tokens: ContinuationTokens = 64,
    question_turn: Annotated[
        bool,
        typer.Option(
            "--question-turn",
            help="Put each needle question in a user message of its own after the document's, "
            "as when a cached document is asked: `deep=turn` then keeps only the question deep "
            "(in the default one-message layout it keeps the whole document deep).",
        ),
    ] = False,
    shared_prefill: Annotated[
        bool,
        typer.Option(
            "--shared-prefill",
            help="Needle and RULER tasks: prefill each sample once with full attention; full "
            "and every SPEED method (not selfonly or stride) start from that cache, since "
            "SPEED's lower layers and anchors are full attention's. A sweep over cutoffs and "
            "anchors then costs about one prefill per sample; answers equal separate runs up "
            "to rounding. SPEED's TTFT is then not measured (RULER records leave it empty). "
            "Not with --query-agnostic.",
        ),
    ] = False,
    query_agnostic: Annotated[
        bool,
        typer.Option(
            "--query-agnostic",
            help="RULER: cache each sample's context (everything before its question) first, "
            "as a document that later questions reuse, then ask the question from that cache. "
            "Only methods whose cache does not depend on what follows can (full, speed).",
        ),
    ] = False,
    split: Annotated[
        str,
        typer.Option(
            "--split",
            help="Haystack text and sanity prompts: eval (measuring) or calib (designing "
            "settings), of the essays, or of another corpus as CORPUS:SPLIT (pydocs:eval: "
            "Python's documentation, text no training and no RULER task uses).",
        ),
    ] = "eval",
    out: OutDir = Path("runs/eval"),
    resume: Annotated[
        bool, typer.Option("--resume", help="Keep the runs already in OUT/records.jsonl.")
    ] = False,
    ruler_data: Annotated[
        Path | None,
        typer.Option(
            "--ruler-data",
            metavar="DIR",
            help="Where RULER's generated samples are kept and reused (default "
            "$SPEEDKV_CACHE/ruler): one jsonl per package version, tokenizer, length, seed, "
            "sample count and task, in the package's own layout, so every method and later "
            "run answers the same prompts.",
        ),
    ] = None,
    reference: Annotated[
        str | None,
        typer.Option(
            "--reference",
            metavar="MODEL",
            help="Fidelity and sanity compare every method with full attention on this model "
            "(same tokenizer) instead of the evaluated model's own: e.g. a full-depth "
            "fine-tune, to measure a SPEED-trained model against it.",
        ),
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Measure what methods cost in quality: needle retrieval, fidelity to full attention,
    short-prompt sanity and RULER, per prompt length. With --adapter, every method runs with it
    (the full reference included)."""
    from speedkv.evals.report import markdown_tables
    from speedkv.evals.runner import EvalConfig, EvalRunner
    from speedkv.evals.tasks import parse_depths, parse_n, parse_tasks
    from speedkv.prompts.haystack import parse_split

    task_list = parse_tasks(tasks)
    if parse_split(split)[1] not in ("eval", "calib"):
        raise UserError(f"split must be eval or calib (of any corpus), got '{split}'")
    options = model.options
    config = EvalConfig(
        model=options.label,
        methods=list(methods),
        tasks=task_list,
        lengths=list(lengths),
        n=parse_n(samples, task_list),
        seed=seed,
        dtype=options.dtype,
        depths=parse_depths(depths),
        fidelity_tokens=continuation_tokens,
        split=split,
        adapter=str(options.adapter) if options.adapter is not None else None,
        question_turn=question_turn,
        shared_prefill=shared_prefill,
        query_agnostic=query_agnostic,
        reference=reference,
        ruler_data=str(ruler_data) if ruler_data is not None else None,
    )
    # decoded as generate and serve decode (prepacked by default), so quality is measured on
    # the kernels users run
    evaluated = model.build()
    against = None
    if reference is not None:  # the reference model as loaded, with no adapter or int8
        against = model.build(model=reference, adapter=None, weights="native")
    runner = EvalRunner(evaluated, config, out, against)
    result = runner.run(resume=resume, log=log)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(markdown_tables(result))
        log(f"results in {out}/ (results.json, records.jsonl, tables.md, misses.md, plots)")


@commands.command("eval-report")
def eval_report_command(
    directories: Annotated[
        list[Path],
        typer.Argument(
            help="A `speedkv eval --out` directory, or several: then one table compares them "
            "(a row per run and method).",
            metavar="DIRECTORY...",
        ),
    ],
    command: Annotated[
        str | None,
        typer.Option("--command", help="The command that regenerates it, quoted in the page."),
    ] = None,
    findings: Annotated[
        Path | None,
        typer.Option(
            "--findings",
            metavar="FILE",
            help="A markdown file of what the numbers say, placed after the overview table.",
        ),
    ] = None,
    page: Annotated[
        Path | None,
        typer.Option(
            "--page",
            metavar="FILE",
            help="Write the page to this file instead of stdout, with its plots in a folder of "
            "the same name beside it (docs/results.md -> docs/results/).",
        ),
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Print the results page (markdown) of an evaluation: setup, method, every table. With
    several directories, one table compares them instead."""
    from speedkv.evals.report import FIGURES, comparison_markdown, results_markdown

    if page is not None and page.suffix != ".md":
        raise UserError(f"--page must name a markdown file ending in .md, got '{page}'")
    notes = read_text_file(findings, "findings file") if findings is not None else None
    results = [read_results(directory) for directory in directories]
    if len(results) > 1:
        if as_json:
            print(json.dumps({str(d): r["summary"] for d, r in zip(directories, results)}))
            return
        text = comparison_markdown(results, command) + (f"\n{notes.strip()}\n" if notes else "")
        if page is None:
            print(text, end="")
        else:
            page.write_text(text)
            log(f"wrote {page}")
        return
    directory, result = directories[0], results[0]
    if as_json:
        print(json.dumps(result["summary"], indent=2))
        return
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


def read_results(directory: Path) -> dict:
    """The results.json of an evaluation directory, or one sentence on why it is not one."""
    path = directory / "results.json"
    if not path.is_file():
        raise UserError(f"'{path}' does not exist; run `speedkv eval --out {directory}` first")
    try:
        result = json.loads(read_text_file(path, "results file"))
    except json.JSONDecodeError as err:
        raise UserError(f"'{path}' is not valid JSON ({err.msg})") from None
    if not isinstance(result, dict) or not {"config", "summary"} <= result.keys():
        raise UserError(f"'{path}' is not the results.json of a `speedkv eval` run")
    return result
