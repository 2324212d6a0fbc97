"""SPEED-aware LoRA fine-tuning (`speedkv train`).

- `forward`: the SPEED teacher-forcing forward (lower layers over the whole sequence, upper
  layers over anchors and deep positions only) and its loss, with optional distillation,
- `tasks`, `data`: the built-in data mix from training essays, users' JSONL, tokenisation,
- `trainer`: the run on the HF Trainer (checkpoints, resume, logs), with `callbacks` (progress
  bar, probes) and `plots` (the loss curve),
- `adapters`: training records and applying an adapter for inference,
- `stepbench`: tokens/s of a SPEED step against a full step on the same batch,
- `probe`: a quality probe on calibration text during training,
- `command`: the `speedkv train` and `speedkv train-bench` commands.

Importing this package is cheap; torch, transformers and peft load inside the modules.
"""
