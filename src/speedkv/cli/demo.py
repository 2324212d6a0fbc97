"""`make demo`: one question about a long document, answered with full attention and with
SPEED, side by side with what each cost."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import typer

from speedkv.bench.memory import peak_rss_bytes, reset_peak_rss
from speedkv.cli.common import MODEL_HELP
from speedkv.core.engine import Engine
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.core.spec import split_spec
from speedkv.hf.loading import load_model
from speedkv.log import log as _log
from speedkv.prompts.haystack import haystack_text, plant

FACT = "The name of the lighthouse keeper's cat is Biscuit, and she sleeps on the third step."
QUESTION = "According to the text above, what is the name of the lighthouse keeper's cat?"


log = partial(_log, source="demo")


def run_demo(
    model: str, methods: list[str], tokens: int, dtype: str, as_json: bool, adapter=None
) -> dict:
    for method in methods:
        split_spec(method)
    log(f"loading {model} (the first run converts the GGUF once, ~20 s)")
    loaded = load_model(model, dtype=dtype)
    engine = Engine(loaded)
    specs = list(dict.fromkeys(["full"] + [make_policy(m, loaded.shape).spec() for m in methods]))
    trained_for, adapted = None, None
    if adapter is not None:  # the adapter's own method runs with it; full stays the base model
        from speedkv.hf.adapters import apply_adapter, read_adapter_info

        trained_for = read_adapter_info(adapter).get("method")
        adapted = Engine(apply_adapter(loaded, adapter))
    # the calibration split: demo prompts are designed, and the eval split is kept for measuring
    document = plant(haystack_text(loaded.tokenizer, tokens, split="calib"), FACT, depth=0.7)
    prompt = f"{document}\n\n{QUESTION}"
    sampling = SamplingParams(max_new_tokens=32)
    log("warming up")
    engine.generate([engine.request("Hello.", "full", sampling=SamplingParams(max_new_tokens=2))])
    rows = []
    for spec in specs:
        runner = adapted if adapted is not None and spec == trained_for else engine
        request = runner.request(prompt, spec, sampling=sampling)
        new = sampling.max_new_tokens
        log(f"{spec}: prefill of {len(request.ids)} tokens, then up to {new} new tokens")
        reset_peak_rss()
        result = runner.generate([request])[0]
        rows.append(
            {
                "method": result.method + (" + adapter" if runner is adapted else ""),
                "answer": result.text.strip(),
                "ttft_s": result.ttft_s,
                "tpot_s": result.tpot_s,
                "kv_bytes": result.kv_bytes,
                "kv_bytes_final": result.kv_bytes_final,
                "peak_rss_bytes": peak_rss_bytes(),
                "prompt_tokens": len(result.prompt_ids),
            }
        )
    base = rows[0]
    for row in rows:
        for key, ratio in (
            ("ttft_s", "ttft_ratio"),
            ("tpot_s", "tpot_ratio"),
            ("kv_bytes", "kv_ratio"),
        ):
            row[ratio] = row[key] / base[key] if base[key] else float("nan")
    report = {
        "model": loaded.name,
        "dtype": loaded.dtype_name,
        "fact": FACT,
        "question": QUESTION,
        "rows": rows,
    }
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return report


def print_report(report: dict) -> None:
    rows = report["rows"]
    print(f"\nDocument: {rows[0]['prompt_tokens']} tokens of essays with one planted fact:")
    print(f"  {report['fact']}")
    print(f"Question: {report['question']}\n")
    for row in rows:
        print(f"  {row['method']}:\n    {row['answer']}")
    print()
    width = max(len(row["method"]) for row in rows)
    columns = ("TTFT s", "TPOT ms", "KV MiB", "TTFT x", "TPOT x", "KV x")
    header = f"{'method':<{width}} " + " ".join(f"{c:>8}" for c in columns)
    print(header)
    print("-" * len(header))
    formats = (".2f", ".1f", ".2f", ".3f", ".3f", ".3f")
    for row in rows:
        cells = (
            row["ttft_s"],
            row["tpot_s"] * 1e3,
            row["kv_bytes"] / 2**20,
            row["ttft_ratio"],
            row["tpot_ratio"],
            row["kv_ratio"],
        )
        print(f"{row['method']:<{width}} " + " ".join(f"{c:>8{f}}" for c, f in zip(cells, formats)))
    print(
        f"\n({report['model']}, {report['dtype']}; ratios are against full, measured in this run; "
        "KV is what the cache holds at the first new token)"
    )


commands = typer.Typer()


@commands.command()
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
    from speedkv.cli.demo import run_demo
    from speedkv.cli.options import parse_methods

    run_demo(
        model=model,
        methods=parse_methods(methods),
        tokens=tokens,
        dtype=dtype,
        as_json=as_json,
        adapter=adapter,
    )
