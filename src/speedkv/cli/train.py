"""`speedkv train`, `speedkv train-bench` and `speedkv train-compare`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from speedkv.cli.common import ModelArgs, command_line, read_text_file, set_threads
from speedkv.cli.options import (
    AsJson,
    Methods,
    OutDir,
    Seed,
    model_options,
    parsed_option,
    split_commas,
)
from speedkv.core.registry import MethodSpec
from speedkv.errors import UserError
from speedkv.train.data import DEFAULT_TEXT
from speedkv.train.trainer import DEFAULT_LR, TrainConfig
from speedkv.train.weights import DEFAULT_TARGETS

DATA_HELP = (
    "'builtin' (needles, passkeys, key-value lookups, variable tracking, several keys at once, "
    "word counting, continuation and short instructions, on --text), "
    "'builtin:needle=3,continue=2,...' to reweight, or a "
    '.jsonl file of {"messages": [...]} or {"prompt", "response"} records.'
)
TEXT_HELP = (
    "Where the built-in mix's text comes from: 'pydocs' (the training split of the Python "
    "standard library's documentation, which no evaluation uses) or 'essays' (the training "
    "split of the Paul Graham essays, which are RULER's haystack: training on them inflates "
    "RULER scores)."
)


def _bf16_default(value: bool | None, device: str) -> bool:
    """bf16 autocast unless asked otherwise where it is fast: GPUs and CPUs with bf16 matmuls."""
    if value is not None:
        return value
    import torch

    from speedkv.kernels.cpu import cpu_has_bf16_matmul

    return (device != "cpu" and torch.cuda.is_available()) or cpu_has_bf16_matmul()


def _modules(value: str) -> list[str]:
    names = split_commas(value)
    if not names:
        raise UserError("--target-modules must name at least one module, e.g. q_proj,v_proj")
    return names


def _trainable(text: str) -> MethodSpec:
    from speedkv.train.forward import check_trainable

    return check_trainable(text)


TrainMethod = Annotated[
    MethodSpec,
    parsed_option(
        "--method",
        parse=_trainable,
        metavar="SPEC",
        help="What to train for: 'speed:lcut=22,anchors=bos' (any SPEED spec) or 'full' (the "
        "same LoRA without SPEED, the fair baseline).",
    ),
]
LoraRank = Annotated[
    int | None, typer.Option("--lora-r", help="LoRA rank (default 16; not with --full).")
]
FullParameters = Annotated[
    bool,
    typer.Option(
        "--full",
        help="Train every weight (full-parameter fine-tuning) instead of LoRA adapters; the "
        "result is a model directory that every command takes as --model.",
    ),
]
GradientCheckpointing = Annotated[
    bool,
    typer.Option(
        "--gradient-checkpointing",
        help="Recompute each layer's activations in the backward pass: a third less memory "
        "for a fifth more time (SmolLM2, --full, 2K tokens).",
    ),
]
Bf16 = Annotated[
    bool | None,
    typer.Option("--bf16/--no-bf16", help="bf16 autocast (default: on where bf16 is fast)."),
]
Distill = Annotated[
    float,
    typer.Option(
        "--distill",
        help="Weight in [0, 1] of KL to the untrained model at full depth (adapter off, or "
        "with --full a frozen copy of the starting weights) on the response tokens; the rest "
        "is cross-entropy.",
    ),
]

commands = typer.Typer()


@commands.command("train")
@model_options("device", "threads", before={"device": "resume"})
def train(
    *,
    out: OutDir,
    model: ModelArgs,
    method: TrainMethod = "speed",
    data: Annotated[str, typer.Option("--data", help=DATA_HELP)] = "builtin",
    text: Annotated[str, typer.Option("--text", help=TEXT_HELP)] = DEFAULT_TEXT,
    full_parameters: FullParameters = False,
    lora_r: LoraRank = None,
    lora_alpha: Annotated[
        int | None, typer.Option("--lora-alpha", help="LoRA alpha, scale alpha/r (default 32).")
    ] = None,
    lora_dropout: Annotated[
        float | None, typer.Option("--lora-dropout", help="LoRA dropout (default 0).")
    ] = None,
    target_modules: Annotated[
        Sequence[str] | None,
        parsed_option(
            "--target-modules",
            parse=_modules,
            metavar="NAMES",
            help="Comma-separated module names that get LoRA adapters (default: "
            + ",".join(DEFAULT_TARGETS)
            + ").",
        ),
    ] = None,
    lr: Annotated[
        float | None,
        typer.Option(
            "--lr",
            help=f"Peak learning rate (AdamW; default {DEFAULT_LR['lora']:g} for LoRA, "
            f"{DEFAULT_LR['full']:g} with --full).",
        ),
    ] = None,
    steps: Annotated[
        int | None,
        typer.Option("--steps", help="Optimizer steps (default: --epochs passes over the data)."),
    ] = None,
    epochs: Annotated[
        float, typer.Option("--epochs", help="Passes over the data if no --steps.")
    ] = 1.0,
    examples: Annotated[
        int | None,
        typer.Option(
            "--examples",
            help="Records in the built-in mix (default: steps x batch x grad-accum, or 500).",
        ),
    ] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Longest example in tokens.")] = 2048,
    batch: Annotated[int, typer.Option("--batch", help="Examples per device per micro-step.")] = 1,
    grad_accum: Annotated[
        int, typer.Option("--grad-accum", help="Micro-steps per optimizer step.")
    ] = 1,
    warmup_steps: Annotated[int, typer.Option("--warmup-steps", help="Linear warm-up steps.")] = 10,
    seed: Seed = 0,
    distill: Distill = 0.0,
    distill_temperature: Annotated[
        float,
        typer.Option("--distill-temperature", help="Softmax temperature of the distillation KL."),
    ] = 1.0,
    keep_full: Annotated[
        float,
        typer.Option(
            "--keep-full",
            help="Weight of a second KL term: the trained weights at full depth against the "
            "untrained model at full depth, on the same response tokens. It keeps what full "
            "depth answers while SPEED is trained; the upper layers run a second time each step.",
        ),
    ] = 0.0,
    match_hidden: Annotated[
        float,
        typer.Option(
            "--match-hidden",
            help="Weight of a hidden-state term: SPEED's states after each layer from the cutoff "
            "up, against the untrained model's at full depth, at the rows that predict the "
            "response (squared error relative to the teacher's norm, summed over tokens, "
            "averaged over layers). Not combined with --keep-full.",
        ),
    ] = 0.0,
    bf16: Bf16 = None,
    save_every: Annotated[
        int, typer.Option("--save-every", help="Steps between checkpoints.")
    ] = 50,
    log_every: Annotated[int, typer.Option("--log-every", help="Steps between log entries.")] = 5,
    probe_every: Annotated[
        int,
        typer.Option(
            "--probe-every", help="Steps between quality probes on calibration text (0 = off)."
        ),
    ] = 0,
    save_dtype: Annotated[
        str,
        typer.Option(
            "--save-dtype", help="dtype of the final adapter or model: bfloat16 or float32."
        ),
    ] = "bfloat16",
    gradient_checkpointing: GradientCheckpointing = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out.")] = False,
    as_json: AsJson = False,
) -> None:
    """SPEED-aware fine-tuning, LoRA or (--full) every weight: prompt positions shallow,
    response positions deep, loss on the response. The run (adapter or model, checkpoints,
    training.json) goes to --out, where --resume continues it. Scales to several GPUs with
    `accelerate launch`."""
    from speedkv.train.data import parse_mix
    from speedkv.train.trainer import log, run_training

    lora = _lora_options(full_parameters, lora_r, lora_alpha, lora_dropout, target_modules)
    device = model.options.device
    if device not in ("auto", "cpu", "cuda"):
        raise UserError(
            f"training runs on auto, cpu or cuda (under `accelerate launch` each process takes "
            f"its own GPU), got '{device}'"
        )
    config = TrainConfig(
        out=str(out),
        model=model.options.model,
        method=method.text,
        data=data,
        text=text,
        **lora,
        lr=lr if lr is not None else DEFAULT_LR["full" if full_parameters else "lora"],
        steps=steps,
        epochs=epochs,
        examples=examples,
        seq_len=seq_len,
        batch=batch,
        grad_accum=grad_accum,
        warmup_steps=warmup_steps,
        seed=seed,
        distill=distill,
        distill_temperature=distill_temperature,
        keep_full=keep_full,
        match_hidden=match_hidden,
        bf16=_bf16_default(bf16, device),
        save_every=save_every,
        log_every=log_every,
        probe_every=probe_every,
        save_dtype=save_dtype,
        full_parameters=full_parameters,
        gradient_checkpointing=gradient_checkpointing,
    ).validate()
    if parse_mix(data) is None:  # a .jsonl file: unreadable or binary fails before any loading
        read_text_file(Path(data), "data file")
    set_threads(model.threads)  # the trainer loads the model itself
    record = run_training(config, resume=resume, command=command_line(), device=device)
    if as_json:
        print(json.dumps(record, indent=2))
        return
    minutes = record["wall_time_s"] / 60
    log(
        f"{record['steps']} steps in {minutes:.1f} min, {_shown(record['tokens_per_s'])} "
        f"tokens/s, final loss {_shown(record['final_loss'])}"
    )
    if full_parameters:
        print(f"model: {out}  (use it with --model {out})")
    else:
        print(f"adapter: {out}  (use it with --adapter {out})")


@commands.command("train-compare")
def train_compare(
    runs: Annotated[
        list[Path],
        typer.Argument(
            help="Run directories (finished or still running) or shipped adapter folders."
        ),
    ],
    plot: Annotated[
        Path | None,
        typer.Option("--plot", metavar="FILE", help="Write the curves to this PNG."),
    ] = None,
    x_axis: Annotated[
        str,
        typer.Option("--x", help="x axis of the plot: 'minutes' (training wall time) or 'step'."),
    ] = "minutes",
    as_json: AsJson = False,
) -> None:
    """Quality against training time: the probe points of several runs side by side."""
    from speedkv.train.compare import X_AXES, probe_table, run_probes
    from speedkv.train.plots import plot_probe_comparison

    if x_axis not in X_AXES:
        raise UserError(f"--x must be 'minutes' or 'step', got '{x_axis}'")
    if plot is not None and plot.suffix.lower() != ".png":
        raise UserError(f"--plot writes a PNG; give a path ending in .png, not '{plot}'")
    found = [run_probes(run) for run in runs]
    if plot is not None:
        plot_probe_comparison(found, plot, x_axis)
    if as_json:
        print(json.dumps(found, indent=2))
        return
    print(probe_table(found))
    if plot is not None:
        print(f"plot: {plot}")


@commands.command("train-bench")
@model_options("device", "threads")
def train_bench(
    *,
    model: ModelArgs,
    methods: Methods = "speed",
    seq_len: Annotated[
        int, typer.Option("--seq-len", help="Tokens per example (the longest, with --mix).")
    ] = 2048,
    response_len: Annotated[
        int, typer.Option("--response-len", help="Response tokens per example (not with --mix).")
    ] = 128,
    mix: Annotated[
        bool,
        typer.Option("--mix", help="Measure on built-in mix records instead of fixed-length text."),
    ] = False,
    batch: Annotated[int, typer.Option("--batch", help="Examples in the measured batch.")] = 2,
    repeats: Annotated[int, typer.Option("--repeats", help="Measured steps per method.")] = 3,
    distill: Distill = 0.0,
    full_parameters: FullParameters = False,
    lora_r: LoraRank = None,
    gradient_checkpointing: GradientCheckpointing = False,
    seed: Seed = 0,
    bf16: Bf16 = None,
    as_json: AsJson = False,
) -> None:
    """Tokens/s and peak memory of a SPEED training step against a full one on the same
    batch, LoRA or (--full) every weight."""
    from speedkv.train.data import DEFAULT_WEIGHTS, build_mix, tokenize_all
    from speedkv.train.forward import check_trainable, visibility_for
    from speedkv.train.stepbench import fixed_batch, measure_step_speed
    from speedkv.train.trainer import trained_weights

    lora = _lora_options(full_parameters, lora_r, None, None, None)
    lora["lora_alpha"] = 2 * lora["lora_r"]

    wanted = [check_trainable(m) for m in ("full", *methods)]
    if repeats < 1 or batch < 1:
        raise UserError("--repeats and --batch must be at least 1")
    if not 1 <= response_len < seq_len:
        raise UserError("--response-len must be at least 1 and shorter than --seq-len")
    loaded = model.build(dtype="float32")
    # bound once; a cutoff the model does not have fails here; the same method twice runs once
    rules = list({v.spec: v for v in (visibility_for(m, loaded.shape) for m in wanted)}.values())
    if mix:
        weights = {k: v for k, v in DEFAULT_WEIGHTS.items() if k != "instruct"}
        records = build_mix(loaded.tokenizer, batch, weights, seq_len, seed, progress=False)
        examples, _ = tokenize_all(loaded.tokenizer, records, seq_len)
    else:
        examples = fixed_batch(loaded.tokenizer, batch, seq_len, response_len, seed)
    config = TrainConfig(
        out="",
        **lora,
        distill=distill,
        full_parameters=full_parameters,
        gradient_checkpointing=gradient_checkpointing,
    )
    use_bf16 = _bf16_default(bf16, model.options.device)
    weights = trained_weights(loaded, config)
    result = measure_step_speed(weights, rules, examples, repeats, distill, use_bf16)
    result["model"] = loaded.name
    result["threads"] = model.threads
    if as_json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"batch: {result['batch_examples']} examples, {result['batch_tokens']} tokens "
        f"({result['response_tokens']} in responses); bf16 autocast {use_bf16}, "
        f"distill {distill}; {result['trainable_parameters']:,} trained parameters "
        f"({'every weight' if full_parameters else 'LoRA'})"
    )
    width = max(len(r["method"]) for r in result["rows"])
    header = ("step s", "tokens/s", "speed-up", "CPU s", "CPU x", "work", "peak GiB")
    print(f"{'method':<{width}}  " + "  ".join(f"{h:>8}" for h in header))
    for row in result["rows"]:
        cells = (row["step_s"], row["tokens_per_s"], row["speedup"], row["cpu_s"])
        formats = (".2f", ".0f", ".2f", ".2f")
        print(
            f"{row['method']:<{width}}  "
            + "  ".join(f"{c:>8{f}}" for c, f in zip(cells, formats))
            + f"  {row['cpu_speedup']:>8.2f}  {row['layer_token_share']:>8.3f}"
            + f"  {row['peak_rss_gib']:>8.2f}"
        )
    print(
        "(medians of interleaved steps; speed-ups are against full, measured in this run; "
        "work = layer-token rows against full; peak = the process's resident memory during "
        "the method's steps)"
    )


def _lora_options(full_parameters: bool, r, alpha, dropout, targets) -> dict:
    """The LoRA fields of the run's configuration; LoRA options with --full are an error
    rather than silently unused."""
    given = {
        "--lora-r": r, "--lora-alpha": alpha, "--lora-dropout": dropout,
        "--target-modules": targets,
    }  # fmt: skip
    if full_parameters:
        named = [option for option, value in given.items() if value is not None]
        if named:
            raise UserError(
                f"--full trains every weight; {', '.join(named)} "
                f"{'applies' if len(named) == 1 else 'apply'} to LoRA only"
            )
    defaults = TrainConfig(out="")
    return {
        "lora_r": defaults.lora_r if r is None else r,
        "lora_alpha": defaults.lora_alpha if alpha is None else alpha,
        "lora_dropout": defaults.lora_dropout if dropout is None else dropout,
        "target_modules": list(defaults.target_modules if targets is None else targets),
    }


def _shown(value: float | None) -> str:
    return "n/a" if value is None else str(value)
