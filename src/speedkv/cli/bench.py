"""`speedkv bench`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from speedkv.bench.report import HF
from speedkv.cli.common import ModelArgs, command_line
from speedkv.cli.options import (
    METHODS_HELP,
    AsJson,
    Lengths,
    MaxNewTokens,
    OutDir,
    count_option,
    model_options,
    parse_methods,
    parsed_option,
    split_methods,
)
from speedkv.core.registry import MethodSpec, parse_spec
from speedkv.errors import UserError
from speedkv.log import log

if TYPE_CHECKING:
    from speedkv.hf.build import ModelOptions


def parse_bench_methods(text: str) -> list[MethodSpec | str]:
    """Specs parsed like every --methods, and 'hf' (the model's own generate)."""
    return [m if m == HF else parse_spec(m) for m in split_methods(text)]


def parse_reusable_methods(text: str) -> list[MethodSpec]:
    """Specs of methods whose cache can be reused; the engine's refusal for any other."""
    from speedkv.core.engine import check_reusable

    specs = parse_methods(text)
    for spec in specs:
        check_reusable(spec.cls)  # reusability is a property of the method, not of a model
    return specs


ReusableMethods = Annotated[
    Sequence[MethodSpec],
    parsed_option(
        "--methods",
        parse=parse_reusable_methods,
        metavar="SPECS",
        help=f"{METHODS_HELP} Only methods whose cache can be reused: full and speed.",
    ),
]
Repeats = Annotated[
    int, count_option("--repeats", least=1, help="Measured runs per cell (after one warm-up).")
]
Resume = Annotated[bool, typer.Option("--resume", help="Skip runs already in OUT/runs.jsonl.")]

BenchMethods = Annotated[
    Sequence[str],
    parsed_option(
        "--methods",
        parse=parse_bench_methods,
        metavar="SPECS",
        help=f"{METHODS_HELP} 'hf' is the model's own generate() (with --dtype auto, in float32 "
        "on a CPU without bf16 products, where transformers' bfloat16 layers are a plain loop).",
    ),
]

commands = typer.Typer()


@commands.command()
@model_options("adapter", "dtype", "weights", "prepack", "device", "threads", "backend", "vllm_arg")
def bench(
    *,
    model: ModelArgs,
    methods: BenchMethods = "full;speed",
    lengths: Lengths = "1024,2048,4096,8192",
    max_new_tokens: MaxNewTokens = 128,
    repeats: Repeats = 5,
    out: OutDir = Path("runs/bench"),
    resume: Resume = False,
    readme: Annotated[
        Path | None,
        typer.Option(
            "--readme",
            metavar="FILE",
            help="Also write the markdown report here (images linked relatively).",
        ),
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Measure TTFT, TPOT, KV bytes, peak RSS and FLOPs per method and prompt length.

    The same run measures this machine's read bandwidth and matmul rate and reports every
    TTFT and TPOT as a multiple of its hardware limit. With --adapter the merged weights run:
    what they cost is the base model's cost. With --backend vllm every method runs on its own
    vLLM engine (full is stock vLLM), prefix caching off for all of them, each repeat on a
    prompt of its own shared by the methods.
    """
    from speedkv.bench.runner import Bench, BenchConfig

    if max_new_tokens < 2:
        raise UserError(f"max-new-tokens must be at least 2 (TPOT needs two), got {max_new_tokens}")
    config = BenchConfig(
        model=model.options.label,
        methods=list(methods),
        lengths=list(lengths),
        new_tokens=max_new_tokens,
        repeats=repeats,
        dtype=model.options.dtype,
        command=command_line(),
    )
    if model.backend == "vllm":
        runner = vllm_bench(model.options, config, out, model.vllm_args)
    else:
        if model.vllm_args:
            raise UserError("--vllm-arg is for --backend vllm")
        runner = Bench(model.build(), config, out)
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


def vllm_bench(options: ModelOptions, config, out: Path, vllm_args: list[str]):
    """`bench --backend vllm`: every method checked against what vLLM runs before any loads."""
    from speedkv.cli.common import on_adapter, vllm_model
    from speedkv.vllm.args import engine_args
    from speedkv.vllm.bench import VllmBench
    from speedkv.vllm.offline import cpu_engine_defaults, engine_kwargs, quiet_vllm_logs

    if options.weights != "native":
        raise UserError("--weights is speedkv's own engine's; drop it with --backend vllm")
    if HF in config.methods:
        raise UserError("'hf' is transformers' generate; --backend vllm runs full and speed")
    built = vllm_model(options, "full")
    config.methods = [on_adapter(options, method) for method in config.methods]
    for method in config.methods:
        engine_args(str(method), built.directory)
    quiet_vllm_logs()
    cpu_engine_defaults(1)  # GiB per method's engine: one request at a time
    config.dtype = built.dtype
    return VllmBench(built.directory, config, out, engine_kwargs(vllm_args))


@commands.command("bench-reuse")
@model_options("adapter", "dtype", "weights", "device", "threads")
def bench_reuse(
    *,
    model: ModelArgs,
    methods: ReusableMethods = "full;speed;speed:deep=turn",
    lengths: Lengths = "1024,2048,4096",
    questions: Annotated[
        int,
        count_option(
            "--questions",
            least=1,
            help="Questions asked of each document (about 30 tokens each, at most 6).",
        ),
    ] = 3,
    max_new_tokens: MaxNewTokens = 4,
    repeats: Repeats = 3,
    out: OutDir = Path("runs/bench-reuse"),
    resume: Resume = False,
    as_json: AsJson = False,
) -> None:
    """Measure a question's TTFT over a cached document against the same prompt from scratch.

    Per method and document length (--lengths counts the document's tokens): the document's
    prefill time and KV, then each question asked over the cache and from scratch, back to
    back, and their ratio. Writes results.json, results.csv, table.md, report.md and
    reuse.png to OUT (docs/reuse.md).
    """
    from speedkv.bench.reuse import ReuseBench, ReuseBenchConfig
    from speedkv.bench.reuse_report import markdown_table

    config = ReuseBenchConfig(
        model=model.options.label,
        methods=list(methods),
        lengths=list(lengths),
        questions=questions,
        new_tokens=max_new_tokens,
        repeats=repeats,
        dtype=model.options.dtype,
        command=command_line(),
    )
    result = ReuseBench(model.build(), config, out).run(resume=resume)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(markdown_table(result))
        log(f"results in {out}/ (results.json, results.csv, table.md, report.md, reuse.png)")
