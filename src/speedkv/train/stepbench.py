"""Tokens per second of a training step under each method, on the same batch.

The methods run interleaved in one process (full first in every round), so the ratios
compare like with like on a shared machine. A step is the forward and backward of the
teacher-forcing loss over the batch (the optimizer update is the same for every method and
negligible next to it).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
from tqdm import tqdm

from speedkv.bench.memory import peak_rss_bytes, reset_peak_rss
from speedkv.prompts.builders import raw_passage
from speedkv.prompts.haystack import sentence_count
from speedkv.train.data import Example
from speedkv.train.forward import SpeedObjective, Visibility
from speedkv.train.weights import trainable_parameters


def fixed_batch(
    tokenizer, count: int, seq_len: int, response_len: int = 128, seed: int = 0
) -> list[Example]:
    """`count` examples of exactly `seq_len` tokens of training-essay text, the last
    `response_len` of them the response: every method sees the same work."""
    import random

    rng = random.Random(seed)
    sentences = sentence_count("train")
    batch = []
    for _ in range(count):
        ids = raw_passage(tokenizer, seq_len, "train", rng.randrange(sentences))
        ids = torch.tensor(ids, dtype=torch.long)
        batch.append(Example(ids, seq_len - response_len, None, "bench"))
    return batch


def layer_token_ratio(shape, vis, batch: list[Example]) -> float:
    """Rows the SPEED forward runs through decoder layers, as a share of a full forward's:
    lcut * T + (L - lcut) * (anchors + deep + response), summed over the batch."""
    layers = shape.num_layers
    full = sum(layers * int(e.ids.numel()) for e in batch)
    deep = sum(
        min(
            int(e.ids.numel()),
            vis.anchors + vis.deep_tokens(e.header_tokens, e.turn_tokens) + e.response_len,
        )
        for e in batch
    )
    speed = sum(vis.lcut * int(e.ids.numel()) for e in batch) + (layers - vis.lcut) * deep
    return speed / full if vis.lcut < layers else 1.0


def measure_step_speed(
    weights,
    methods: list[Visibility],
    batch: list[Example],
    repeats: int = 3,
    distill: float = 0.0,
    bf16: bool = True,
) -> dict:
    """Median step time and tokens/s per method (by canonical spec), plus each one's speed-up
    over the first method. `weights` is what trains (`speedkv.train.weights`)."""
    weights.model.train()  # as in a run; activation checkpointing acts only in train mode
    objectives = {vis.spec: SpeedObjective(weights, vis, distill) for vis in methods}
    shape = weights.backbone.shape
    shares = {spec: layer_token_ratio(shape, o.vis, batch) for spec, o in objectives.items()}
    tokens = sum(int(e.ids.numel()) for e in batch)
    times: dict[str, list[float]] = {spec: [] for spec in objectives}
    cpu: dict[str, list[float]] = {spec: [] for spec in objectives}
    peak: dict[str, int] = {spec: 0 for spec in objectives}
    rounds = repeats + 1  # the first round warms up and is not counted
    bar = tqdm(total=rounds * len(objectives), desc="training steps", leave=False)
    for round_index in range(rounds):
        for spec, objective in objectives.items():
            reset_peak_rss()
            start, start_cpu = time.perf_counter(), time.process_time()
            with _autocast(bf16):
                loss = objective(batch)["loss"]
            loss.backward()
            weights.model.zero_grad(set_to_none=True)
            if round_index > 0:
                times[spec].append(time.perf_counter() - start)
                cpu[spec].append(time.process_time() - start_cpu)
            peak[spec] = max(peak[spec], peak_rss_bytes())
            bar.update(1)
    bar.close()
    baseline = next(iter(objectives))
    base_time = statistics.median(times[baseline])
    base_cpu = statistics.median(cpu[baseline])
    rows = []
    for spec, values in times.items():
        median = statistics.median(values)
        median_cpu = statistics.median(cpu[spec])
        rows.append(
            {
                "method": spec,
                "step_s": round(median, 3),
                "step_s_all": [round(v, 3) for v in values],
                "tokens_per_s": round(tokens / median, 1),
                "speedup": round(base_time / median, 3),
                # CPU seconds of this process: steadier than wall time on a shared machine
                "cpu_s": round(median_cpu, 3),
                "cpu_speedup": round(base_cpu / median_cpu, 3),
                # the work a step does in decoder layers, against full (exact, no timing)
                "layer_token_share": round(shares[spec], 4),
                # the whole process at its highest during this method's steps (weights,
                # gradients, activations; not the optimizer state, which a step leaves alone)
                "peak_rss_gib": round(peak[spec] / 2**30, 2),
            }
        )
    return {
        "baseline": baseline,
        "batch_examples": len(batch),
        "batch_tokens": tokens,
        "response_tokens": sum(e.response_len for e in batch),
        "repeats": repeats,
        "distill": distill,
        "bf16_autocast": bf16,
        "weights": weights.kind,
        "trainable_parameters": trainable_parameters(weights.model),
        "rows": rows,
    }


def _autocast(bf16: bool):
    if not bf16:
        return contextlib.nullcontext()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.autocast(device, dtype=torch.bfloat16)
