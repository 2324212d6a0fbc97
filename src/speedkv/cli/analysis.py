"""`speedkv diagnose` (the layer-wise cutoff diagnostic) and `speedkv choose-lcut` (the
smallest cutoff meeting a fidelity budget)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from speedkv.cli.common import MODEL_HELP, check_adapter, load
from speedkv.errors import UserError
from speedkv.log import log

if TYPE_CHECKING:
    from speedkv.hf.loading import LoadedModel

ANCHORS_HELP = "SPEED anchors: bos, none or sink:K."


commands = typer.Typer()


@commands.command("diagnose")
def diagnose_command(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help=MODEL_HELP),
    prompts_file: Path | None = typer.Option(
        None, "--prompts", help="Prompts, one per line (default: built-in prompts)."
    ),
    n: int | None = typer.Option(
        None, "--n", help="Prompts to use (default: 8 built-in, or every line of --prompts)."
    ),
    new_tokens: int = typer.Option(32, "--new-tokens", help="Greedy tokens per prompt."),
    doc_tokens: int = typer.Option(
        512, "--doc-tokens", help="Passage length of the built-in document questions."
    ),
    lcut: int | None = typer.Option(
        None, "--lcut", help="SPEED cutoff for the second heatmap (default round(0.75 L))."
    ),
    anchors: str = typer.Option("bos", "--anchors", help=ANCHORS_HELP),
    out: Path = typer.Option(Path("runs/diagnose"), "--out", help="Directory for results."),
    dtype: str = typer.Option("auto", "--dtype", help="auto, float32 or bfloat16."),
    as_json: bool = typer.Option(False, "--json", help="Print diagnosis.json to stdout."),
) -> None:
    """Layer-wise cutoff diagnostic: where generated tokens attend (prefill, BoS, earlier
    tokens), how selective their prompt attention is, and where the residual trajectory
    straightens, per layer, with full attention and with SPEED; writes figures and JSON."""
    from speedkv.analysis.diagnose import default_prompts, diagnose
    from speedkv.analysis.diagnose_plots import write_figures
    from speedkv.core.engine import Engine
    from speedkv.hf.text import encode_prompt
    from speedkv.methods.speed import parse_anchors

    if n is not None and n < 1:
        raise UserError(f"--n must be at least 1, got {n}")
    if new_tokens < 3:
        raise UserError(
            f"--new-tokens must be at least 3 (curvature needs three), got {new_tokens}"
        )
    if doc_tokens < 16:
        raise UserError(f"--doc-tokens must be at least 16, got {doc_tokens}")
    parse_anchors(anchors)
    lines = read_prompt_lines(prompts_file) if prompts_file else None
    loaded = load(model, dtype)
    shape = loaded.shape
    lcut = round(0.75 * shape.num_layers) if lcut is None else lcut
    if not 0 <= lcut < shape.num_layers:
        raise UserError(f"--lcut must be between 0 and {shape.num_layers - 1}, got {lcut}")
    if lines is not None:
        prompts = [encode_prompt(loaded.tokenizer, line).ids for line in lines[:n]]
    else:
        prompts = default_prompts(loaded.tokenizer, n or 8, doc_tokens)
    longest = max(len(p) for p in prompts) + new_tokens
    if longest > shape.max_positions:
        raise UserError(
            f"a prompt plus {new_tokens} new tokens needs {longest} positions, more than the "
            f"model's context of {shape.max_positions}"
        )
    log(f"{len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens)")
    result = diagnose(Engine(loaded), prompts, new_tokens, lcut, anchors)
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


def read_prompt_lines(path: Path) -> list[str]:
    """Non-empty lines of a UTF-8 text file, one prompt each."""
    if not path.is_file():
        raise UserError(f"prompt file '{path}' does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"prompt file '{path}' is not UTF-8 text (one prompt per line)") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise UserError(f"prompt file '{path}' has no prompts (one per line)")
    return lines


@commands.command("choose-lcut")
def choose_lcut_command(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help=MODEL_HELP),
    budget: str = typer.Option(
        "agreement=0.95",
        "--budget",
        help="Fidelity to keep: agreement=0.95 (top-1 agreement with full, at least), "
        "ppl_ratio=1.05 or kl=0.05 (at most); join several with commas.",
    ),
    candidates: str | None = typer.Option(
        None, "--candidates", help="Cutoffs to try: '0..L' (default), '16..30' or '18,20,22'."
    ),
    anchors: str = typer.Option("bos", "--anchors", help=ANCHORS_HELP),
    deep: int = typer.Option(1, "--deep", help="Last prompt tokens kept at full depth."),
    n: int = typer.Option(4, "--n", help="Calibration passages."),
    prompt_tokens: int = typer.Option(1024, "--prompt-tokens", help="Prompt length P."),
    new_tokens: int = typer.Option(
        64, "--new-tokens", help="Teacher-forced continuation tokens K per passage."
    ),
    context: int | None = typer.Option(
        None, "--context", help="Prompt length for the expected savings (default: the model's)."
    ),
    adapter: Path | None = typer.Option(
        None,
        "--adapter",
        help="SPEED-aware LoRA adapter from `speedkv train`: cutoffs run with it and are "
        "compared with the base model's full attention.",
    ),
    compare_separate: bool = typer.Option(
        False,
        "--compare-separate",
        help="Also evaluate every cutoff on its own and report the time ratio (slow).",
    ),
    dtype: str = typer.Option("auto", "--dtype", help="auto, float32 or bfloat16."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Choose SPEED's cutoff: measure fidelity against full attention (top-1 agreement,
    perplexity ratio, KL) at every candidate cutoff in one shared pass over calibration text,
    and print the smallest cutoff meeting the budget with its expected TTFT / KV savings."""
    from speedkv.analysis.cutoff import calib_passages, parse_budget, parse_candidates
    from speedkv.core.registry import make_policy
    from speedkv.methods.speed import parse_anchors

    wanted = parse_budget(budget)
    num_anchors = parse_anchors(anchors)
    check_adapter(adapter)
    if n < 1:
        raise UserError(f"--n must be at least 1, got {n}")
    if new_tokens < 1:
        raise UserError(f"--new-tokens must be at least 1, got {new_tokens}")
    if deep < 1 or prompt_tokens < num_anchors + deep + 1:
        raise UserError(
            f"--prompt-tokens ({prompt_tokens}) must exceed anchors + deep tokens, and "
            f"--deep must be at least 1 (got {deep})"
        )
    if context is not None and context < num_anchors + deep + 1:
        raise UserError(f"--context must exceed anchors + deep tokens, got {context}")
    loaded = load(model, dtype)
    shape = loaded.shape
    cuts = parse_candidates(candidates or f"0..{shape.num_layers}", shape.num_layers)
    if prompt_tokens + new_tokens > shape.max_positions:
        raise UserError(
            f"--prompt-tokens + --new-tokens must fit the model's context of "
            f"{shape.max_positions}, got {prompt_tokens + new_tokens}"
        )
    passages = calib_passages(loaded.tokenizer, n, prompt_tokens, new_tokens)
    log(f"{n} calibration passages of {prompt_tokens}+{new_tokens} tokens, {len(cuts)} cutoffs")
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
    result.update(model=loaded.name, dtype=loaded.dtype_name)
    chosen = result["lcut"]
    spec = f"speed:lcut={chosen},anchors={anchors},deep={deep}"
    result["spec"] = make_policy(spec, shape).spec() if chosen is not None else None
    if as_json:
        print(json.dumps(result))
        return
    print(choice_table(result))


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
    from speedkv.analysis.calibrate import calibrate_tsp, default_prompts
    from speedkv.core.engine import Engine
    from speedkv.hf.text import encode_prompt
    from speedkv.methods.scoring import check_budget

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
