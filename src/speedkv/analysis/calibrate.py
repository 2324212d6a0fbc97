"""`speedkv calibrate-tsp`: FastKV's TSP-layer selection (Jo et al., Eq. 3).

For every candidate layer L <= L_max, run the calibration prompts with Token-Selective
Propagation at L (and no cache compression) and measure how far the final hidden state of
the last prompt token moves from full context: the squared L2 distance normalised by the
full-context state's squared norm, averaged over prompts. The chosen layer is the earliest
one whose distance is within `tolerance` of the smallest (tolerance 0: the argmin, ties to
the earliest).
"""

from __future__ import annotations

from dataclasses import dataclass

from tqdm import tqdm

from speedkv.core.engine import Engine
from speedkv.core.registry import make_policy
from speedkv.errors import UserError
from speedkv.prompts.builders import passage_prompt
from speedkv.prompts.haystack import sentence_pool, sentence_tokens


@dataclass
class TspCalibration:
    layer: int
    distances: dict[int, float]  # candidate layer -> mean normalised squared distance
    tsp_rate: float
    max_layer: int
    prompts: int

    def spec(self) -> str:
        return f"fastkv:tsp_layer={self.layer},tsp_rate={self.tsp_rate:g}"


def calibrate_tsp(
    engine: Engine,
    prompts: list[list[int]],
    tsp_rate: float = 0.2,
    max_layer: int | None = None,
    min_layer: int = 0,
    tolerance: float = 0.0,
    progress: bool = True,
) -> TspCalibration:
    L = engine.shape.num_layers
    max_layer = L // 2 if max_layer is None else max_layer
    if not 0 <= min_layer <= max_layer < L:
        raise UserError(
            f"TSP layers must satisfy 0 <= min <= max <= {L - 1}, got {min_layer}..{max_layer}"
        )
    if not prompts:
        raise UserError("calibration needs at least one prompt")
    if tolerance < 0:
        raise UserError(f"tolerance must be >= 0, got {tolerance}")
    candidates = list(range(min_layer, max_layer + 1))
    totals = dict.fromkeys(candidates, 0.0)
    bar = tqdm(
        total=len(prompts) * (len(candidates) + 1),
        disable=not progress,
        desc="calibrate-tsp",
        unit="prefill",
    )
    for ids in prompts:
        reference = engine.prefill_ids(ids, make_policy("full", engine.shape)).hidden.float()
        bar.update()
        for layer in candidates:
            spec = f"fastkv:tsp_layer={layer},tsp_rate={tsp_rate:g},retain=1"
            hidden = engine.prefill_ids(ids, make_policy(spec, engine.shape)).hidden.float()
            totals[layer] += float((hidden - reference).pow(2).sum() / reference.pow(2).sum())
            bar.update()
    bar.close()
    distances = {layer: total / len(prompts) for layer, total in totals.items()}
    best = min(distances.values())
    chosen = next(
        layer for layer in candidates if distances[layer] <= best * (1 + tolerance) + 1e-12
    )
    return TspCalibration(chosen, distances, tsp_rate, max_layer, len(prompts))


def default_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """Built-in calibration prompts of about `length` tokens: passages of the calibration
    essays (never used by evaluation or training) with a request to summarise, through the
    chat template. Each passage starts where the previous one stopped."""
    parts = sentence_pool(split="calib")
    prompts, start = [], 0
    for _ in range(n):
        chunk, count = [], 0
        while start < len(parts) and count < length - 24:  # room for the template
            chunk.append(parts[start])
            count += sentence_tokens(tokenizer, parts[start])
            start += 1
        prompts.append(passage_prompt(tokenizer, " ".join(chunk), "Summarise the passage above."))
    return prompts
