"""`speedkv diagnose` (the layer-wise cutoff diagnostic) and `speedkv choose-lcut` (the
smallest cutoff from which every deeper one meets a fidelity budget)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from speedkv.cli.common import ModelArgs, read_prompt_lines
from speedkv.cli.options import (
    AsJson,
    ContinuationTokens,
    MaxNewTokens,
    OutDir,
    PromptsFile,
    PromptTokens,
    Samples,
    count_option,
    model_options,
    parsed_option,
)
from speedkv.errors import UserError
from speedkv.log import log

if TYPE_CHECKING:
    from speedkv.hf.loading import LoadedModel


def checked_anchors(text: str) -> str:
    from speedkv.methods.speed import parse_anchors

    parse_anchors(text)
    return text


Anchors = Annotated[
    str | None,
    parsed_option(
        "--anchors",
        parse=checked_anchors,
        metavar="ANCHORS",
        help="SPEED anchors: bos, first, none or sink:K (default: bos where the model's "
        "prompts begin with a BoS token, else the measured default for such models).",
    ),
]
Deep = Annotated[
    int | None,
    typer.Option(
        "--deep",
        min=1,
        help="Last prompt tokens kept at full depth, like generated tokens (default: SPEED's "
        "default, 64; 1 is the paper's).",
    ),
]

commands = typer.Typer()


@commands.command("diagnose")
@model_options("dtype", "device", "threads")
def diagnose_command(
    *,
    model: ModelArgs,
    prompts_file: PromptsFile = None,
    samples: Samples = None,
    max_new_tokens: MaxNewTokens = 32,
    doc_tokens: Annotated[
        int,
        count_option(
            "--doc-tokens",
            least=16,
            help="Passage length of the built-in document questions (half the built-in "
            "prompts; the others are short instructions).",
        ),
    ] = 512,
    lcut: Annotated[
        int | None,
        typer.Option("--lcut", help="SPEED cutoff for the second heatmap (default round(0.75 L))."),
    ] = None,
    anchors: Anchors = None,
    deep: Deep = None,
    out: OutDir = Path("runs/diagnose"),
    as_json: AsJson = False,
) -> None:
    """Layer-wise cutoff diagnostic: where generated tokens attend (prefill, BoS, earlier
    tokens), how selective their prompt attention is, and where the residual trajectory
    straightens, per layer, with full attention and with SPEED; writes figures and JSON.
    Runs on 8 built-in prompts, or every line of --prompts-file, unless --samples says how
    many."""
    from speedkv.analysis.diagnose import default_prompts, diagnose
    from speedkv.analysis.diagnose_plots import write_figures
    from speedkv.core.engine import Engine
    from speedkv.hf.text import encode_prompt

    if max_new_tokens < 3:
        raise UserError(
            f"--max-new-tokens must be at least 3 (curvature needs three), got {max_new_tokens}"
        )
    lines = read_prompt_lines(prompts_file) if prompts_file else None
    loaded = model.build()
    shape = loaded.shape
    lcut = round(0.75 * shape.num_layers) if lcut is None else lcut
    if not 0 <= lcut < shape.num_layers:
        raise UserError(f"--lcut must be between 0 and {shape.num_layers - 1}, got {lcut}")
    if lines is not None:
        prompts = [encode_prompt(loaded.tokenizer, line).ids for line in lines[:samples]]
    else:
        prompts = default_prompts(loaded.tokenizer, samples or 8, doc_tokens)
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > shape.max_positions:
        raise UserError(
            f"a prompt plus {max_new_tokens} new tokens needs {longest} positions, more than "
            f"the model's context of {shape.max_positions}"
        )
    log(f"{len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens)")
    result = diagnose(Engine(loaded), prompts, max_new_tokens, lcut, anchors, deep)
    result["model"] = loaded.name
    result["dtype"] = loaded.dtype_name
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnosis.json").write_text(json.dumps(result, indent=1))
    figures = write_figures(result, out)
    if as_json:
        print(json.dumps(result))
        return
    print(diagnosis_table(result))
    log(f"results in {out}/ (diagnosis.json, {', '.join(p.name for p in figures)})")


def diagnosis_table(result: dict) -> str:
    full, speed = result["variants"]["full"], result["variants"]["speed"]

    def cell(value) -> str:
        return "    -" if value is None else f"{value:5.3f}"

    lines = [
        f"{'layer':>5}  {'prefill':>7}  {'BoS':>5}  {'decode':>6}  {'self':>5}  "
        f"{'entropy':>7}  {'tok-curv':>8}  {'SPEED prefill':>13}"
    ]
    for layer in range(result["model_layers"]):
        a = full["attention"]
        curve = full["token_curvature"][layer]
        lines.append(
            f"{layer:>5}  {cell(a['prefill'][layer]):>7}  {cell(a['bos'][layer])}  "
            f"{cell(a['decode'][layer]):>6}  {cell(a['self'][layer])}  "
            f"{cell(full['prompt_entropy'][layer]):>7}  "
            f"{'-' if curve is None else f'{curve:.1f}':>8}  "
            f"{cell(speed['attention']['prefill'][layer]):>13}"
        )
    marks = ", ".join(f"{k} = {v}" for k, v in result["candidates"].items())
    lines.append(f"\ncandidate cutoffs: {marks or 'none'}")
    return "\n".join(lines)


@commands.command("choose-lcut")
@model_options(
    "adapter", "dtype", "device", "threads",
    before={"adapter": "compare_separate", "dtype": "as_json"},
)  # fmt: skip
def choose_lcut_command(
    *,
    model: ModelArgs,
    budget: Annotated[
        str,
        typer.Option(
            "--budget",
            help="Fidelity to keep: agreement=0.95 (top-1 agreement with full, at least), "
            "ppl_ratio=1.05 or kl=0.05 (at most); join several with commas.",
        ),
    ] = "agreement=0.95",
    candidates: Annotated[
        str | None,
        typer.Option(
            "--candidates", help="Cutoffs to try: '0..L' (default), '16..30' or '18,20,22'."
        ),
    ] = None,
    anchors: Anchors = None,
    deep: Deep = None,
    samples: Samples = 4,
    prompt_tokens: PromptTokens = 1024,
    continuation_tokens: ContinuationTokens = 64,
    context: Annotated[
        int | None,
        typer.Option(
            "--context", help="Prompt length for the expected savings (default: the model's)."
        ),
    ] = None,
    compare_separate: Annotated[
        bool,
        typer.Option(
            "--compare-separate",
            help="Also evaluate every cutoff on its own and report the time ratio (slow).",
        ),
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            help="Write a figure of agreement and perplexity ratio against the cutoff (PNG).",
        ),
    ] = None,
    plot_with: Annotated[
        list[Path] | None,
        typer.Option(
            "--plot-with",
            exists=True,
            dir_okay=False,
            help="Also draw this earlier sweep (saved from --json) in the --plot figure, e.g. "
            "the same model with other anchors; repeatable.",
        ),
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Choose SPEED's cutoff: measure fidelity against full attention (top-1 agreement,
        perplexity ratio, KL) at every candidate cutoff in one shared pass over calibration text,
        and print the smallest cutoff from which every deeper candidate meets the budget (a lucky
    low cutoff below a failing one is not trusted), with its expected TTFT / KV savings.
        With --adapter (a SPEED-aware LoRA from `speedkv train`), cutoffs run with it and are
        compared with the base model's full attention."""
    from speedkv.analysis.cutoff import calib_passages, parse_budget, parse_candidates
    from speedkv.core.registry import make_policy
    from speedkv.methods.speed import DEFAULT_DEEP, parse_anchors, resolve_anchors

    wanted = parse_budget(budget)
    if plot_with and plot is None:
        raise UserError("--plot-with draws into the --plot figure; give --plot PATH too")
    earlier = [read_sweep(path) for path in plot_with or []]
    deep = DEFAULT_DEEP if deep is None else deep
    # the sweep runs transformers' own layers over every position, not speedkv's kernels; the
    # adapter goes on after, since the base model is the sweep's reference
    adapter = model.options.adapter
    loaded = model.build(adapter=None, native_decode=False)
    for path, other in zip(plot_with or [], earlier):
        if other.get("model") != loaded.name:
            raise UserError(f"{path} is a sweep of {other.get('model')}, not of {loaded.name}")
    shape = loaded.shape
    anchors = resolve_anchors(anchors, shape)  # the default depends on the model
    num_anchors = parse_anchors(anchors)
    if prompt_tokens < num_anchors + deep + 1:
        raise UserError(
            f"--prompt-tokens ({prompt_tokens}) must exceed anchors + deep tokens "
            f"({num_anchors} + {deep})"
        )
    if context is not None and context < num_anchors + deep + 1:
        raise UserError(f"--context must exceed anchors + deep tokens, got {context}")
    cuts = parse_candidates(candidates or f"0..{shape.num_layers}", shape.num_layers)
    if prompt_tokens + continuation_tokens > shape.max_positions:
        raise UserError(
            f"--prompt-tokens + --continuation-tokens must fit the model's context of "
            f"{shape.max_positions}, got {prompt_tokens + continuation_tokens}"
        )
    passages = calib_passages(loaded.tokenizer, samples, prompt_tokens, continuation_tokens)
    log(
        f"{samples} calibration passages of {prompt_tokens}+{continuation_tokens} tokens, "
        f"{len(cuts)} cutoffs"
    )
    adapted = None
    if adapter is not None:
        from speedkv.hf.adapters import apply_adapter

        adapted = apply_adapter(loaded, adapter)
    result = choose_lcut(
        adapted or loaded,
        passages,
        prompt_tokens,
        cuts,
        wanted,
        num_anchors,
        deep,
        context,
        compare_separate,
        reference=loaded if adapted is not None else None,
    )
    result.update(model=loaded.name, dtype=loaded.dtype_name, anchors_spec=anchors)
    if plot is not None:
        from speedkv.analysis.cutoff_plots import plot_cutoff_sweeps

        log(f"figure: {plot_cutoff_sweeps([result, *earlier], plot)}")
    chosen = result["lcut"]
    spec = f"speed:lcut={chosen},anchors={anchors},deep={deep}"
    result["spec"] = make_policy(spec, shape).spec() if chosen is not None else None
    if as_json:
        print(json.dumps(result))
        return
    print(choice_table(result))


def read_sweep(path: Path) -> dict:
    """An earlier `choose-lcut --json` result, checked enough to plot."""
    try:
        result = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"{path} is not choose-lcut's JSON output: {error}") from None
    if not isinstance(result, dict) or not isinstance(result.get("cutoffs"), dict):
        raise UserError(f"{path} is not choose-lcut's JSON output (no 'cutoffs')")
    return result


def choose_lcut(
    loaded: LoadedModel,
    passages: list[list[int]],
    prompt_tokens: int,
    cuts: list[int],
    wanted: dict[str, float],
    anchors: int,
    deep: int,
    context: int | None,
    compare_separate: bool,
    reference: LoadedModel | None = None,
) -> dict:
    """The sweep, the choice and its expected savings as one JSON-ready dict."""
    from speedkv.analysis.cutoff import expected_savings, meets, smallest_meeting, sweep

    shape = loaded.shape
    base = reference.backbone if reference is not None else None
    shared = sweep(loaded.backbone, passages, prompt_tokens, cuts, anchors, deep, reference=base)
    chosen = smallest_meeting(shared.rows, wanted)
    context = context or shape.max_positions
    result = {
        "lcut": chosen,
        "budget": wanted,
        "candidates": cuts,
        "cutoffs": {
            str(cut): {**row, "meets_budget": meets(row, wanted)}
            for cut, row in shared.rows.items()
        },
        "passages": shared.passages,
        "prompt_tokens": shared.prompt_tokens,
        "new_tokens": shared.new_tokens,
        "anchors": anchors,
        "deep": deep,
        "split": "calib",
        "sweep_seconds": shared.seconds,
        "savings": expected_savings(shape, chosen, context, anchors, deep)
        if chosen is not None
        else None,
    }
    if compare_separate:
        log("evaluating every cutoff on its own for comparison")
        alone = sweep(loaded.backbone, passages, prompt_tokens, cuts, anchors, deep, shared=False)
        result["separate"] = {
            "seconds": alone.seconds,
            "speedup": alone.seconds / shared.seconds,
            "max_abs_difference": max(
                abs(alone.rows[c][k] - shared.rows[c][k])
                for c in cuts
                for k in ("agreement", "ppl_ratio", "kl")
            ),
        }
    return result


def choice_table(result: dict) -> str:
    lines = [f"{'lcut':>5}  {'agreement':>9}  {'ppl_ratio':>9}  {'kl':>8}  meets"]
    for cut, row in result["cutoffs"].items():
        mark = "yes" if row["meets_budget"] else "no"
        chosen = "  <- chosen" if result["lcut"] is not None and int(cut) == result["lcut"] else ""
        lines.append(
            f"{cut:>5}  {row['agreement']:>9.4f}  {row['ppl_ratio']:>9.4f}  {row['kl']:>8.4f}  "
            f"{mark}{chosen}"
        )
    budget = ", ".join(f"{k}={v:g}" for k, v in result["budget"].items())
    if "separate" in result:
        sep = result["separate"]
        lines.append(
            f"\nshared pass {result['sweep_seconds']:.1f} s, each cutoff on its own "
            f"{sep['seconds']:.1f} s ({sep['speedup']:.1f}x); largest difference "
            f"{sep['max_abs_difference']:.2e}"
        )
    if result["lcut"] is None:
        lines.append(f"\nno candidate cutoff meets {budget}; use full attention")
        return "\n".join(lines)
    s = result["savings"]
    lines.append(
        f"\nlcut {result['lcut']} meets {budget} on {result['passages']} calibration passages: "
        f"use --method '{result['spec']}'"
    )
    lines.append(
        f"expected at {s['context']} prompt tokens (cost model): TTFT -{s['ttft_saving']:.1%}, "
        f"KV -{s['kv_saving']:.1%}, decode FLOPs x{s['decode_flops_ratio']:.3f}"
    )
    return "\n".join(lines)


@commands.command("calibrate-tsp")
@model_options("dtype", "device", "threads")
def calibrate_tsp_command(
    *,
    model: ModelArgs,
    tsp_rate: Annotated[
        float, typer.Option("--tsp-rate", help="Share of tokens TSP propagates.")
    ] = 0.2,
    max_layer: Annotated[
        int | None, typer.Option("--max-layer", help="Latest candidate layer (default L/2).")
    ] = None,
    min_layer: Annotated[int, typer.Option("--min-layer", help="Earliest candidate layer.")] = 0,
    tolerance: Annotated[
        float,
        typer.Option(
            "--tolerance", help="Pick the earliest layer within this relative margin of the best."
        ),
    ] = 0.0,
    prompts_file: PromptsFile = None,
    samples: Samples = 4,
    prompt_tokens: PromptTokens = 1024,
    as_json: AsJson = False,
) -> None:
    """Choose FastKV's TSP layer: the earliest layer whose final hidden states stay closest to
    full context (FastKV, Eq. 3); prints every candidate's distance. Runs on --samples
    built-in prompts of --prompt-tokens, or on every line of --prompts-file."""
    from speedkv.analysis.calibrate import calibrate_tsp, default_prompts
    from speedkv.core.engine import Engine
    from speedkv.hf.text import encode_prompt
    from speedkv.methods.scoring import check_budget

    check_budget(tsp_rate, "tsp-rate")
    lines = read_prompt_lines(prompts_file) if prompts_file else None
    loaded = model.build()
    if lines is not None:
        prompts = [encode_prompt(loaded.tokenizer, line).ids for line in lines]
    else:
        prompts = default_prompts(loaded.tokenizer, samples, prompt_tokens)
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
