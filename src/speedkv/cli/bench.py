"""`speedkv bench`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from speedkv.cli.common import MODEL_HELP, check_adapter, command_line, load
from speedkv.errors import UserError
from speedkv.log import log

commands = typer.Typer()


@commands.command()
def bench(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help=MODEL_HELP),
    methods: str = typer.Option(
        "full;speed:lcut=22,anchors=bos",
        "--methods",
        help="Method specs separated by ';'. 'hf' is the model's own generate(); "
        "full is always added.",
    ),
    lengths: str = typer.Option(
        "1024,2048,4096,8192", "--lengths", help="Prompt lengths in tokens."
    ),
    new_tokens: int = typer.Option(128, "--new-tokens", help="Tokens generated per run."),
    repeats: int = typer.Option(5, "--repeats", help="Measured runs per cell (after one warm-up)."),
    out: Path = typer.Option(Path("runs/bench"), "--out", help="Directory for results."),
    dtype: str = typer.Option("auto", "--dtype", help="auto, float32 or bfloat16."),
    resume: bool = typer.Option(False, "--resume", help="Skip runs already in OUT/runs.jsonl."),
    readme: Path | None = typer.Option(
        None, "--readme", help="Also write the markdown report here (images linked relatively)."
    ),
    adapter: Path | None = typer.Option(
        None,
        "--adapter",
        help="LoRA adapter directory from `speedkv train`, merged into the model.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print results.json to stdout."),
) -> None:
    """Measure TTFT, TPOT, KV bytes, peak RSS and FLOPs per method and prompt length.

    The same run measures this machine's read bandwidth and matmul rate and reports every
    TTFT and TPOT as a multiple of its hardware limit.
    """
    from speedkv.bench.runner import Bench, BenchConfig
    from speedkv.cli.options import parse_lengths, parse_methods
    from speedkv.core.spec import split_spec

    config = BenchConfig(
        model=model,
        methods=parse_methods(methods),
        lengths=parse_lengths(lengths),
        new_tokens=new_tokens,
        repeats=repeats,
        dtype=dtype,
        command=command_line(),
    )
    for spec in config.methods:
        if spec != "hf":
            split_spec(spec)
    if repeats < 1:
        raise UserError(f"repeats must be at least 1, got {repeats}")
    check_adapter(adapter)
    loaded = load(model, dtype, adapter=adapter)  # merged weights: the base model's cost
    runner = Bench(loaded, config, out)
    result = runner.run(resume=resume)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        from speedkv.bench.report import markdown_table

        print(markdown_table(result))
    if readme is not None:
        import os

        from speedkv.bench.report import report_markdown

        images = os.path.relpath(out.resolve(), readme.resolve().parent)
        readme.write_text(report_markdown(result, images))
        log(f"results in {out}/ (results.json, results.csv, table.md, efficiency.png)")
