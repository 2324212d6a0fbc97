"""The training record (training.json) a run writes beside its adapter or model."""

from __future__ import annotations

from dataclasses import asdict

from speedkv.hf.adapters import FORMAT, MODEL_FORMAT, SHAPE_FIELDS, require_peft


def training_record(loaded, spec: str, config, data: dict, trainable: int, command: str) -> dict:
    """The training.json of a run (steps, wall time and history are added as it goes)."""
    import torch
    import transformers

    from speedkv.version import __version__

    shape = asdict(loaded.shape)
    if config.full_parameters:
        trained = {"full_parameters": {"trainable_parameters": trainable}}
        libraries = {}
    else:
        trained = {
            "lora": {
                "r": config.lora_r,
                "alpha": config.lora_alpha,
                "dropout": config.lora_dropout,
                "target_modules": list(config.target_modules),
                "trainable_parameters": trainable,
            }
        }
        libraries = {"peft": require_peft().__version__}
    return {
        "format": MODEL_FORMAT if config.full_parameters else FORMAT,
        "base_model": loaded.name,
        "model_shape": {k: shape[k] for k in SHAPE_FIELDS},
        "method": spec,
        "data": data,
        "seed": config.seed,
        **trained,
        "recipe": {
            "lr": config.lr,
            "optimizer": "AdamW betas (0.9, 0.99), no weight decay, clip 1.0",
            "schedule": f"{config.warmup_steps} warm-up steps, cosine to 10%",
            "max_steps": config.steps,
            "epochs": config.epochs if config.steps is None else None,
            "batch": config.batch,
            "grad_accum": config.grad_accum,
            "seq_len": config.seq_len,
            "distill": config.distill,
            "distill_temperature": config.distill_temperature,
            "keep_full": config.keep_full,
            "match_hidden": config.match_hidden,
            "bf16_autocast": config.bf16,
            "gradient_checkpointing": config.gradient_checkpointing,
        },
        "command": command,
        "versions": {
            "speedkv": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            **libraries,
        },
    }
