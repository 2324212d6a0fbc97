"""`speedkv train`, `speedkv train-bench` and `speedkv train-compare`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from speedkv.cli.common import MODEL_HELP, THREADS_HELP, command_line, load, set_threads
from speedkv.errors import UserError

METHOD_HELP = (
    "What to train for: 'speed:lcut=22,anchors=bos' (any SPEED spec) or 'full' (the same LoRA "
    "without SPEED, the fair baseline)."
)
DATA_HELP = (
    "'builtin' (needles, passkeys, key-value lookups, variable tracking, continuation, short "
    "instructions from training essays), 'builtin:needle=3,continue=2,...' to reweight, or a "
    '.jsonl file of {"messages": [...]} or {"prompt", "response"} records.'
)


def _bf16_default(value: bool | None) -> bool:
    if value is not None:
        return value
    import torch

    from speedkv.hf.loading import cpu_has_bf16_matmul

    return torch.cuda.is_available() or cpu_has_bf16_matmul()


def _modules(value: str) -> list[str]:
    names = [m.strip() for m in value.split(",") if m.strip()]
    if not names:
        raise UserError("--target-modules must name at least one module, e.g. q_proj,v_proj")
    return names


commands = typer.Typer()


@commands.command("train")
def train(
    out: Path = typer.Option(..., "--out", "-o", help="Run directory (adapter, checkpoints)."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help=MODEL_HELP),
    method: str = typer.Option("speed:lcut=22,anchors=bos", "--method", help=METHOD_HELP),
    data: str = typer.Option("builtin", "--data", help=DATA_HELP),
    lora_r: int = typer.Option(16, "--lora-r", help="LoRA rank."),
    lora_alpha: int = typer.Option(32, "--lora-alpha", help="LoRA alpha (scale alpha/r)."),
    lora_dropout: float = typer.Option(0.0, "--lora-dropout", help="LoRA dropout."),
    target_modules: str = typer.Option(
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "--target-modules",
        help="Comma-separated module names that get LoRA adapters.",
    ),
    lr: float = typer.Option(5e-4, "--lr", help="Peak learning rate (AdamW)."),
    steps: int | None = typer.Option(
        None, "--steps", help="Optimizer steps (default: --epochs passes over the data)."
    ),
    epochs: float = typer.Option(1.0, "--epochs", help="Passes over the data if no --steps."),
    examples: int | None = typer.Option(
        None,
        "--examples",
        help="Records in the built-in mix (default: steps x batch x grad-accum, or 500).",
    ),
    seq_len: int = typer.Option(2048, "--seq-len", help="Longest example in tokens."),
    batch: int = typer.Option(1, "--batch", help="Examples per device per micro-step."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-steps per optimizer step."),
    warmup_steps: int = typer.Option(10, "--warmup-steps", help="Linear warm-up steps."),
    seed: int = typer.Option(0, "--seed", help="Seed for the data mix and training."),
    distill: float = typer.Option(
        0.0,
        "--distill",
        help="Weight in [0, 1] of KL to the frozen full-depth model (adapter off) on the "
        "response tokens; the rest is cross-entropy.",
    ),
    distill_temperature: float = typer.Option(
        1.0, "--distill-temperature", help="Softmax temperature of the distillation KL."
    ),
    bf16: bool | None = typer.Option(
        None, "--bf16/--no-bf16", help="bf16 autocast (default: on where bf16 is fast)."
    ),
    save_every: int = typer.Option(50, "--save-every", help="Steps between checkpoints."),
    log_every: int = typer.Option(5, "--log-every", help="Steps between log entries."),
    probe_every: int = typer.Option(
        0,
        "--probe-every",
        help="Steps between quality probes on calibration text (0 = off).",
    ),
    save_dtype: str = typer.Option(
        "bfloat16", "--save-dtype", help="dtype of the final adapter: bfloat16 or float32."
    ),
    threads: int = typer.Option(0, "--threads", help=THREADS_HELP),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out."),
    as_json: bool = typer.Option(False, "--json", help="Print training.json to stdout."),
) -> None:
    """SPEED-aware LoRA fine-tuning: prompt positions shallow, response positions deep,
    loss on the response. Scales to several GPUs with `accelerate launch`."""
    from speedkv.train.forward import check_trainable
    from speedkv.train.trainer import TrainConfig, log, run_training

    check_trainable(method)  # bad specs fail before anything loads
    config = TrainConfig(
        out=str(out),
        model=model,
        method=method,
        data=data,
        lora_r=lora_r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=_modules(target_modules),
        lr=lr,
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
        bf16=_bf16_default(bf16),
        save_every=save_every,
        log_every=log_every,
        probe_every=probe_every,
        save_dtype=save_dtype,
    ).validate()
    set_threads(threads)
    command = command_line()
    record = run_training(config, resume=resume, command=command)
    if as_json:
        print(json.dumps(record, indent=2))
        return
    minutes = record["wall_time_s"] / 60
    log(
        f"{record['steps']} steps in {minutes:.1f} min, {record['tokens_per_s']} tokens/s, "
        f"final loss {record['final_loss']}"
    )
    print(f"adapter: {out}  (use it with --adapter {out})")


@commands.command("train-compare")
def train_compare(
    runs: list[Path] = typer.Argument(
        ..., help="Run directories (finished or still running) or shipped adapter folders."
    ),
    plot: Path | None = typer.Option(None, "--plot", help="Write the curves to this PNG."),
    x_axis: str = typer.Option(
        "minutes", "--x", help="x axis of the plot: 'minutes' (training wall time) or 'step'."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
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
def train_bench(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help=MODEL_HELP),
    methods: str = typer.Option(
        "speed:lcut=22,anchors=bos",
        "--methods",
        help="Method specs separated by ';' (full or speed); full is always measured first.",
    ),
    seq_len: int = typer.Option(
        2048, "--seq-len", help="Tokens per example (the longest, with --mix)."
    ),
    response_len: int = typer.Option(
        128, "--response-len", help="Response tokens per example (not with --mix)."
    ),
    mix: bool = typer.Option(
        False, "--mix", help="Measure on built-in mix records instead of fixed-length text."
    ),
    batch: int = typer.Option(2, "--batch", help="Examples in the measured batch."),
    repeats: int = typer.Option(3, "--repeats", help="Measured steps per method."),
    distill: float = typer.Option(0.0, "--distill", help="Distillation weight, as in train."),
    lora_r: int = typer.Option(16, "--lora-r", help="LoRA rank."),
    seed: int = typer.Option(0, "--seed", help="Seed of the batch."),
    bf16: bool | None = typer.Option(None, "--bf16/--no-bf16", help="bf16 autocast."),
    threads: int = typer.Option(0, "--threads", help=THREADS_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Tokens/s of a SPEED training step against a full one on the same batch."""
    from speedkv.cli.options import parse_methods
    from speedkv.train.data import DEFAULT_WEIGHTS, build_mix, tokenize_all
    from speedkv.train.forward import check_trainable, visibility_for
    from speedkv.train.stepbench import fixed_batch, measure_step_speed
    from speedkv.train.trainer import TrainConfig, lora_model

    specs = list(dict.fromkeys(["full", *parse_methods(methods)]))
    for spec in specs:
        check_trainable(spec)
    if repeats < 1 or batch < 1:
        raise UserError("--repeats and --batch must be at least 1")
    if not 1 <= response_len < seq_len:
        raise UserError("--response-len must be at least 1 and shorter than --seq-len")
    set_threads(threads)
    loaded = load(model, "float32")
    for spec in specs:
        visibility_for(spec, loaded.shape)  # only full and speed can be trained
    if mix:
        weights = {k: v for k, v in DEFAULT_WEIGHTS.items() if k != "instruct"}
        records = build_mix(loaded.tokenizer, batch, weights, seq_len, seed, progress=False)
        examples, _ = tokenize_all(loaded.tokenizer, records, seq_len)
    else:
        examples = fixed_batch(loaded.tokenizer, batch, seq_len, response_len, seed)
    peft_model = lora_model(
        loaded.hf_model, TrainConfig(out="", lora_r=lora_r, lora_alpha=2 * lora_r)
    )
    use_bf16 = _bf16_default(bf16)
    result = measure_step_speed(peft_model, specs, examples, repeats, distill, use_bf16)
    result["model"] = loaded.name
    result["threads"] = threads
    if as_json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"batch: {result['batch_examples']} examples, {result['batch_tokens']} tokens "
        f"({result['response_tokens']} in responses); bf16 autocast {use_bf16}, "
        f"distill {distill}"
    )
    width = max(len(r["method"]) for r in result["rows"])
    header = ("step s", "tokens/s", "speed-up", "CPU s", "CPU x", "work")
    print(f"{'method':<{width}}  " + "  ".join(f"{h:>8}" for h in header))
    for row in result["rows"]:
        cells = (row["step_s"], row["tokens_per_s"], row["speedup"], row["cpu_s"])
        formats = (".2f", ".0f", ".2f", ".2f")
        print(
            f"{row['method']:<{width}}  "
            + "  ".join(f"{c:>8{f}}" for c, f in zip(cells, formats))
            + f"  {row['cpu_speedup']:>8.2f}  {row['layer_token_share']:>8.3f}"
        )
    print(
        "(medians of interleaved steps; speed-ups are against full, measured in this run; "
        "work = layer-token rows against full)"
    )
