"""SPEED-aware training on the HF Trainer: LoRA adapters, or every weight (`full_parameters`).

The Trainer brings what a run needs: AdamW with warm-up and a cosine schedule, gradient
clipping and accumulation, bf16 autocast, checkpoints with optimizer and RNG state, resuming
where a run stopped (skipping the batches already seen), and `accelerate launch` for several
GPUs. What is ours: the model it trains is `SpeedObjective` (the SPEED teacher-forcing loss
around the trained weights, `speedkv.train.weights`), checkpoints hold only what is trained,
and the logs carry the loss parts, tokens per second, wall time and optional quality probes.

Layout of a run directory OUT:
    run.json                the run's configuration (a resumed run must match it)
    data.jsonl              the built-in mix, built once (a meta line, then records)
    checkpoints/checkpoint-N/   what is trained + training.json + optimizer state
    adapter_config.json, adapter_model.safetensors   LoRA: the final adapter (peft format)
    config.json, model.safetensors, tokenizer files  full parameters: the trained model
    training.json           how it was trained, the log history, tokens/s, wall time
    loss.png                the loss curve (and probe curves if probes ran)
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from speedkv.core.registry import parse_spec
from speedkv.errors import UserError
from speedkv.hf.adapters import INFO_NAME
from speedkv.hf.backbone import enable_activation_checkpointing
from speedkv.log import log as _log
from speedkv.methods.speed import DEFAULT_DEEP
from speedkv.prompts.haystack import CORPORA
from speedkv.train.data import (
    DEFAULT_TEXT,
    MIN_SEQ_LEN,
    Example,
    base_model_responder,
    build_mix,
    load_built,
    mix_spec,
    parse_mix,
    read_jsonl,
    save_jsonl,
    tokenize_all,
)
from speedkv.train.record import training_record
from speedkv.train.weights import DEFAULT_TARGETS, FullWeights, LoraWeights

# options a resumed run may change: they decide what is logged, saved or recomputed, not what
# is learnt
RESUMABLE_CHANGES = {
    "out", "save_every", "log_every", "probe_every", "save_dtype", "gradient_checkpointing",
}  # fmt: skip
# full-parameter checkpoints are the whole model plus AdamW's state (16 bytes a parameter):
# only the newest ones are kept
FULL_CHECKPOINTS_KEPT = 2
# peak learning rates: LoRA's adapters start at zero and take large steps; updating every
# weight of a trained model needs small ones
DEFAULT_LR = {"lora": 5e-4, "full": 5e-5}


@dataclass
class TrainConfig:
    """Everything that defines a run (saved as OUT/run.json)."""

    out: str
    model: str = "smollm2-135m"
    method: str = "speed:lcut=22,anchors=bos"
    data: str = "builtin"
    text: str = DEFAULT_TEXT  # the corpus the built-in mix's text comes from
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    lr: float = DEFAULT_LR["lora"]
    steps: int | None = None  # optimizer steps; None: `epochs` passes over the data
    epochs: float = 1.0
    examples: int | None = None  # size of the built-in mix (default: enough for `steps`)
    seq_len: int = 2048
    batch: int = 1
    grad_accum: int = 1
    warmup_steps: int = 10
    seed: int = 0
    distill: float = 0.0
    distill_temperature: float = 1.0
    keep_full: float = 0.0  # weight of KL(untrained full || trained full), both at full depth
    match_hidden: float = 0.0  # weight of the upper layers' hidden-state error (`hidden_match`)
    bf16: bool = True
    save_every: int = 50
    log_every: int = 5
    probe_every: int = 0
    save_dtype: str = "bfloat16"
    full_parameters: bool = False  # train every weight instead of LoRA adapters
    gradient_checkpointing: bool = False  # recompute layer activations in the backward pass

    def validate(self) -> TrainConfig:
        checks = [
            (self.lora_r >= 1, f"lora-r must be at least 1, got {self.lora_r}"),
            (self.lora_alpha > 0, f"lora-alpha must be positive, got {self.lora_alpha}"),
            (
                0 <= self.lora_dropout < 1,
                f"lora-dropout must be in [0, 1), got {self.lora_dropout}",
            ),
            (bool(self.target_modules), "target-modules must name at least one module"),
            (self.lr > 0, f"lr must be positive, got {self.lr}"),
            (self.steps is None or self.steps >= 1, f"steps must be at least 1, got {self.steps}"),
            (self.epochs > 0, f"epochs must be positive, got {self.epochs}"),
            (self.examples is None or self.examples >= 1, "examples must be at least 1"),
            (self.batch >= 1, f"batch must be at least 1, got {self.batch}"),
            (self.grad_accum >= 1, f"grad-accum must be at least 1, got {self.grad_accum}"),
            (self.warmup_steps >= 0, "warmup-steps must be >= 0"),
            (0 <= self.distill <= 1, f"distill must be in [0, 1], got {self.distill}"),
            (self.distill_temperature > 0, "distill-temperature must be positive"),
            (self.keep_full >= 0, f"keep-full must be >= 0, got {self.keep_full}"),
            (self.match_hidden >= 0, f"match-hidden must be >= 0, got {self.match_hidden}"),
            (
                not (self.keep_full > 0 and self.match_hidden > 0),
                "--keep-full and --match-hidden are not combined: choose one",
            ),
            (self.save_every >= 1, f"save-every must be at least 1, got {self.save_every}"),
            (self.log_every >= 1, f"log-every must be at least 1, got {self.log_every}"),
            (self.probe_every >= 0, "probe-every must be >= 0 (0 turns probes off)"),
            (self.save_dtype in ("float32", "bfloat16"), "save-dtype must be float32 or bfloat16"),
            (self.text in CORPORA, f"text must be one of {', '.join(CORPORA)}, got '{self.text}'"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)
        if self.keep_full > 0 and parse_spec(self.method).name == "full":
            raise UserError(
                "--keep-full pulls full depth toward the untrained model while SPEED is trained; "
                "with --method full the trained rule is full depth itself (use --distill)"
            )
        if self.match_hidden > 0 and parse_spec(self.method).name == "full":
            raise UserError(
                "--match-hidden pulls SPEED's upper layers toward the untrained model at full "
                "depth; with --method full there are no SPEED layers to pull (use --distill)"
            )
        if parse_mix(self.data) is not None and self.seq_len < MIN_SEQ_LEN:
            raise UserError(f"seq-len of the built-in mix must be at least {MIN_SEQ_LEN}")
        if parse_mix(self.data) is None and not Path(self.data).is_file():
            raise UserError(
                f"--data '{self.data}' is neither 'builtin[:task=weight,...]' nor an existing "
                ".jsonl file"
            )
        return self

    @property
    def needs_teacher(self) -> bool:
        """Whether a loss term reads the untrained model's logits."""
        return self.distill > 0 or self.keep_full > 0 or self.match_hidden > 0

    @property
    def examples_per_step(self) -> int:
        return self.batch * self.grad_accum * max(1, int(os.environ.get("WORLD_SIZE", "1")))


log = partial(_log, source="train")


# -- setup ------------------------------------------------------------------------------------
def load_examples(config: TrainConfig, loaded, out: Path) -> tuple[list[Example], dict]:
    """Tokenised examples and a description of the data for training.json."""
    weights = parse_mix(config.data)
    if weights is None:
        path = Path(config.data)
        records = read_jsonl(path)
        described = {"source": str(path.resolve()), "records": len(records)}
    else:
        count = config.examples or (
            config.steps * config.examples_per_step if config.steps else 500
        )
        meta = {
            "mix": mix_spec(weights),
            "count": count,
            "seq_len": config.seq_len,
            "seed": config.seed,
            "model": loaded.name,
            "text": config.text,
        }
        records = load_built(out / "data.jsonl", meta)
        if records is None:
            log(f"building {count} examples of {meta['mix']} (seed {config.seed})")
            responder = base_model_responder(loaded) if weights.get("instruct") else None
            records = build_mix(
                loaded.tokenizer, count, weights, config.seq_len, config.seed, responder,
                text=config.text,
            )  # fmt: skip
            save_jsonl(records, out / "data.jsonl", meta)
        else:
            log(f"reusing {len(records)} examples from {out / 'data.jsonl'}")
        described = {**meta, "source": "builtin", "records": len(records)}
    examples, dropped = tokenize_all(loaded.tokenizer, records, config.seq_len)
    kinds: dict[str, int] = {}
    for example in examples:
        kinds[example.kind] = kinds.get(example.kind, 0) + 1
    described.update(
        kinds=kinds,
        dropped_too_long=dropped,
        sequence_tokens=sum(int(e.ids.numel()) for e in examples),
        response_tokens=sum(e.response_len for e in examples),
    )
    if dropped:
        log(f"{dropped} records longer than --seq-len {config.seq_len} were left out")
    return examples, described


def trained_weights(loaded, config: TrainConfig):
    """What the run trains: LoRA adapters on `loaded`'s model, or all of its weights."""
    if config.full_parameters:
        weights = FullWeights(loaded.hf_model, loaded.tokenizer, teacher=config.needs_teacher)
    else:
        weights = LoraWeights(
            loaded.hf_model,
            config.lora_r,
            config.lora_alpha,
            config.lora_dropout,
            config.target_modules,
            name=loaded.name,
        )
    if config.gradient_checkpointing:
        enable_activation_checkpointing(loaded.hf_model)
    return weights


def training_arguments(config: TrainConfig, out: Path, device: str = "auto"):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(out / "checkpoints"),
        max_steps=config.steps or -1,
        num_train_epochs=config.epochs,
        per_device_train_batch_size=config.batch,
        gradient_accumulation_steps=config.grad_accum,
        learning_rate=config.lr,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        warmup_steps=config.warmup_steps,
        # a run shorter than --log-every still logs its loss and speed once
        logging_steps=min(config.log_every, config.steps) if config.steps else config.log_every,
        save_strategy="steps",
        save_steps=config.save_every,
        save_total_limit=FULL_CHECKPOINTS_KEPT if config.full_parameters else None,
        bf16=config.bf16,
        use_cpu=_device(device) == "cpu",
        seed=config.seed,
        data_seed=config.seed,
        report_to=[],
        remove_unused_columns=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        include_num_input_tokens_seen="no",
        ddp_find_unused_parameters=False,
    )


# -- the trainer ------------------------------------------------------------------------------
def make_trainer_class():
    """The Trainer subclass (built lazily: importing transformers' Trainer is slow)."""
    from transformers import Trainer

    class SpeedTrainer(Trainer):
        """Trainer for `SpeedObjective`: checkpoints of what is trained, loss parts in the
        logs."""

        run_info: dict = {}
        wall_offset = 0.0
        session_start = 0.0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            sums = self._sums
            keys = ("ce_sum", "kl_sum", "kl_full_sum", "hidden_sum", "response_tokens",
                    "sequence_tokens")  # fmt: skip
            for key in keys:
                sums[key] = sums.get(key, 0) + outputs[key]
            return (outputs["loss"], outputs) if return_outputs else outputs["loss"]

        @property
        def _sums(self) -> dict:
            if not hasattr(self, "_metric_sums"):
                self._metric_sums = {}
            return self._metric_sums

        def log(self, logs: dict, start_time: float | None = None) -> None:
            sums = self._sums
            now = time.perf_counter()
            logs["wall_s"] = round(self.wall_offset + now - self.session_start, 2)
            if "loss" in logs and sums.get("response_tokens"):
                logs["ce"] = round(sums["ce_sum"] / sums["response_tokens"], 4)
                if self.objective.distill > 0:
                    logs["kl"] = round(sums["kl_sum"] / sums["response_tokens"], 4)
                if self.objective.keep_full > 0:
                    logs["kl_full"] = round(sums["kl_full_sum"] / sums["response_tokens"], 4)
                if self.objective.match_hidden > 0:
                    logs["hidden"] = round(sums["hidden_sum"] / sums["response_tokens"], 4)
                elapsed = now - sums.get("since", self.session_start)
                logs["tokens_per_s"] = round(sums["sequence_tokens"] / max(elapsed, 1e-9), 1)
                self.total_tokens = getattr(self, "total_tokens", 0) + sums["sequence_tokens"]
                self._metric_sums = {"since": now}
            super().log(logs, start_time)

        def exclude_time(self, seconds: float) -> None:
            """Leave `seconds` (a probe) out of the next tokens/s figure."""
            sums = self._sums
            sums["since"] = sums.get("since", self.session_start) + seconds

        @property
        def objective(self):
            return self.accelerator.unwrap_model(self.model)

        def _save(self, output_dir: str | None = None, state_dict=None) -> None:
            # only what is trained: an adapter, or the model (float32, to resume exactly)
            output_dir = output_dir or self.args.output_dir
            if not self.args.should_save:
                return
            os.makedirs(output_dir, exist_ok=True)
            self.objective.weights.save(output_dir)
            record = {
                **self.run_info,
                "status": "checkpoint",
                "steps": self.state.global_step,
                "wall_time_s": round(
                    self.wall_offset + time.perf_counter() - self.session_start, 1
                ),
            }
            Path(output_dir, INFO_NAME).write_text(json.dumps(record, indent=2))

        def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
            self.accelerator.unwrap_model(model or self.model).weights.load(resume_from_checkpoint)

    return SpeedTrainer


# -- a run ------------------------------------------------------------------------------------
def run_training(
    config: TrainConfig, resume: bool = False, command: str = "", device: str = "auto"
) -> dict:
    """Train (or resume) a run on `device` (auto, cpu or cuda); returns the final training
    record."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from transformers.trainer_utils import get_last_checkpoint

    from speedkv.hf.loading import load_model
    from speedkv.train.callbacks import progress_callback
    from speedkv.train.forward import SpeedObjective, visibility_for
    from speedkv.train.plots import plot_history
    from speedkv.train.weights import (
        available_bytes,
        check_fits,
        full_training_bytes,
        trainable_parameters,
    )

    config.validate()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # HF-internal
    out = Path(config.out)
    checkpoints = out / "checkpoints"
    last = get_last_checkpoint(str(checkpoints)) if checkpoints.is_dir() else None
    config.method = spelled_deep(config.method, DEFAULT_DEEP)
    _check_run_dir(out, config, resume, last)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)

    from accelerate import PartialState

    log(f"loading {config.model} (float32 weights; bf16 autocast: {config.bf16})")
    loaded = load_model(config.model, dtype="float32", device=_device(device), progress=True)
    if loaded.tokenizer is None:
        raise UserError("training needs a model with a tokenizer")
    vis = visibility_for(config.method, loaded.shape)
    if config.seq_len > loaded.shape.max_positions:
        raise UserError(
            f"seq-len {config.seq_len} is longer than the model's context of "
            f"{loaded.shape.max_positions} tokens"
        )
    if config.full_parameters:  # before the data is built: a run that cannot fit stops now
        parts = full_training_bytes(
            loaded.hf_model, config.seq_len, config.batch, config.needs_teacher,
            config.gradient_checkpointing,
        )  # fmt: skip
        check_fits(
            parts, available_bytes(_device(device)), f"full-parameter training of {loaded.name}"
        )
    with PartialState().main_process_first():  # one process builds the mix, the rest read it
        examples, data_info = load_examples(config, loaded, out)
    log(
        f"{len(examples)} examples ({data_info['sequence_tokens']} tokens, "
        f"{data_info['response_tokens']} in responses): {data_info['kinds']}"
    )
    weights = trained_weights(loaded, config)
    objective = SpeedObjective(
        weights, vis, config.distill, config.distill_temperature, config.keep_full,
        config.match_hidden,
    )  # fmt: skip
    trainable = trainable_parameters(objective)

    trainer_class = make_trainer_class()
    trainer = trainer_class(
        model=objective,
        args=training_arguments(config, out, device),
        train_dataset=_ListDataset(examples),
        data_collator=lambda batch: {"examples": batch},
    )
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(progress_callback())
    if config.probe_every:
        from speedkv.train.callbacks import probe_callback
        from speedkv.train.probe import Probe

        probe = Probe(
            loaded.tokenizer, vis, config.seq_len, config.probe_every, config.seed, config.text
        )
        trainer.add_callback(probe_callback(trainer, probe))
    trainer.run_info = training_record(
        loaded, vis.spec, config, data_info, trainable, command=command
    )
    if resume and last:
        trainer.wall_offset = _last_wall_time(last)
        log(f"resuming from {last} ({trainer.wall_offset / 60:.1f} min of training so far)")
    # written once everything loaded: from here on the directory holds a run to resume
    (out / "run.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))
    trainer.session_start = time.perf_counter()
    trainer.train(resume_from_checkpoint=last if resume and last else None)

    wall = trainer.wall_offset + time.perf_counter() - trainer.session_start
    history = trainer.state.log_history
    record = _final_record(trainer, history, wall)
    if trainer.args.should_save:  # the main process writes the results
        weights.save(out, getattr(torch, config.save_dtype))
        (out / INFO_NAME).write_text(json.dumps(record, indent=2))
        plot_history(history, out / "loss.png", f"{loaded.name}, {vis.spec}")
        result = "model" if config.full_parameters else "adapter"
        log(f"{result}, {INFO_NAME} and loss.png in {out}/")
    return record


def _final_record(trainer, history: list[dict], wall: float) -> dict:
    losses = [h["loss"] for h in history if "loss" in h]
    speeds = [h["tokens_per_s"] for h in history if "tokens_per_s" in h]
    return {
        **trainer.run_info,
        "status": "done",
        "steps": trainer.state.global_step,
        "wall_time_s": round(wall, 1),
        "tokens_per_s": round(sum(speeds) / len(speeds), 1) if speeds else None,
        "final_loss": losses[-1] if losses else None,
        "log_history": history,
    }


def _device(wanted: str = "auto") -> str:
    """This process's device: the CPU when asked for or without a GPU, else its own GPU (its
    rank's under `accelerate launch`), where the Trainer puts the model too."""
    if wanted == "cpu" or not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"


def _check_run_dir(out: Path, config: TrainConfig, resume: bool, last: str | None) -> None:
    saved = out / "run.json"
    if not saved.is_file():
        return
    if not resume:
        raise UserError(
            f"'{out}' already holds a training run; pass --resume to continue it or choose "
            "another --out"
        )
    before = json.loads(saved.read_text())
    # a run.json whose SPEED spec leaves deep out was written when the default was deep=1
    before["method"] = spelled_deep(before.get("method", "full"), 1)
    now = dataclasses.asdict(config)
    changed = sorted(k for k in now if before.get(k) != now[k] and k not in RESUMABLE_CHANGES)
    if changed:
        raise UserError(
            f"--resume needs the same options as the run in '{out}'; these differ: "
            + ", ".join(changed)
        )


def spelled_deep(method: str, deep: int | str) -> str:
    """`method` with SPEED's deep suffix written out (as `deep` where the spec leaves it to the
    default): run.json keeps it spelled, so a resumed run cannot change its suffix when
    speedkv's default does."""
    spec = parse_spec(method)
    if spec.name != "speed" or any(key == "deep" for key, _ in spec.options):
        return spec.text
    return spec.text + ("," if ":" in spec.text else ":") + f"deep={deep}"


def _last_wall_time(checkpoint: str) -> float:
    """Training time before this session: what the checkpoint recorded."""
    info = Path(checkpoint, INFO_NAME)
    return float(json.loads(info.read_text()).get("wall_time_s", 0.0)) if info.is_file() else 0.0


class _ListDataset(torch.utils.data.Dataset):
    def __init__(self, items: list):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]
