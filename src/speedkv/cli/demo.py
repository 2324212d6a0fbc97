"""`make demo`: one question about a long document, answered with full attention and with
SPEED, side by side with what each cost."""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import partial
from typing import Annotated

import typer

from speedkv.bench.memory import peak_rss_bytes, reset_peak_rss
from speedkv.cli.common import ModelArgs
from speedkv.cli.options import (
    METHODS_HELP,
    AsJson,
    MaxNewTokens,
    PromptTokens,
    model_options,
    parse_methods,
    parsed_option,
)
from speedkv.core.engine import Engine
from speedkv.core.registry import MethodSpec, fit_to_adapter, make_policy, parse_spec
from speedkv.core.sampling import SamplingParams
from speedkv.hf.loading import LoadedModel, demo_method
from speedkv.log import log as _log
from speedkv.prompts.haystack import haystack_text, plant

FACT = "The name of the lighthouse keeper's cat is Biscuit, and she sleeps on the third step."
QUESTION = "According to the text above, what is the name of the lighthouse keeper's cat?"


log = partial(_log, source="demo")


def run_demo(
    loaded: LoadedModel,
    methods: Sequence[MethodSpec],
    prompt_tokens: int,
    max_new_tokens: int,
    as_json: bool,
    adapted_model: LoadedModel | None = None,
) -> dict:
    """Run the demo; with `adapted_model` (the same model with an adapter merged, loaded the
    same way), each method of the adapter's kind runs on it instead, with the adapter's
    settings where the spec leaves them unset. `full` always runs on the base model."""
    trained_for = adapted_model.trained_method if adapted_model is not None else None
    adapted = Engine(adapted_model) if adapted_model is not None else None
    engine = Engine(loaded)
    fitted = [fit_to_adapter(m, trained_for) for m in methods]
    on_adapter = {m.bind(loaded.shape).spec() for m in fitted if trained_for and m.name != "full"
                  and m.name == parse_spec(trained_for).name}  # fmt: skip
    bound = [make_policy("full", loaded.shape), *(m.bind(loaded.shape) for m in fitted)]
    policies = {policy.spec(): policy for policy in bound}  # full first, each method once
    # the calibration split: demo prompts are designed, and the eval split is kept for measuring
    document = plant(haystack_text(loaded.tokenizer, prompt_tokens, split="calib"), FACT, depth=0.7)
    prompt = f"{document}\n\n{QUESTION}"
    sampling = SamplingParams(max_new_tokens=max_new_tokens)
    log("warming up")
    for warm in (engine, adapted) if adapted is not None else (engine,):
        warm.generate([warm.request("Hello.", "full", sampling=SamplingParams(max_new_tokens=2))])
    rows = []
    for spec, policy in policies.items():
        runner = adapted if adapted is not None and spec in on_adapter else engine
        request = runner.request(prompt, policy, sampling=sampling)
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
@model_options("adapter", "dtype", "weights", "prepack", "device", "threads")
def demo(
    *,
    model: ModelArgs,
    methods: Annotated[
        Sequence[MethodSpec] | None,
        parsed_option(
            "--methods",
            parse=parse_methods,
            metavar="SPECS",
            help=f"{METHODS_HELP} Default: the adapter's own method with --adapter, else "
            "the model's demo method (SmolLM2: speed:lcut=26,anchors=bos,deep=1; Qwen2.5 and "
            "other models: speed, 75 % of the layers).",
        ),
    ] = None,
    prompt_tokens: PromptTokens = 3000,
    max_new_tokens: MaxNewTokens = 32,
    as_json: AsJson = False,
) -> None:
    """Ask one question about a long document with full attention and with SPEED (or any
    methods); print the answers and what each cost. With --adapter, methods of the kind it was
    trained for run with it (by default its own method; a bare `speed` takes its settings), and
    full runs without."""
    adapter = model.options.adapter
    loaded = model.build(adapter=None)
    adapted = None
    if adapter is not None:  # the adapter's own method runs with it; full stays the base model
        # loaded like the base (adapter merged first, then weights and prepacking), so the
        # two differ only in the adapter
        adapted = model.build()
    if methods is None:  # the adapter's own method, else the model's demo method
        trained = adapted.trained_method if adapted is not None else None
        methods = [parse_spec(trained or demo_method(model.options.model))]
    run_demo(loaded, methods, prompt_tokens, max_new_tokens, as_json, adapted)
