"""`speedkv choose-lcut`: the smallest SPEED cutoff that meets a fidelity budget.

Fidelity (the evaluation harness's definition): a prompt is the first P tokens of a held-out
passage and the next K tokens are teacher-forced; at each of the K continuation positions the
method's next-token distribution is compared with full attention's. top-1 agreement = share of
positions whose argmax equals full's; perplexity = exp(mean NLL of the true next tokens);
ppl_ratio = ppl(method) / ppl(full); kl = mean KL(full || method). Numbers pool every position
of every passage.

One pass serves every cutoff. In SPEED's dense form the lower `c` layers of cutoff `c` are
exactly full attention's first `c` layers over all positions, so the full model runs once,
keeping, for every layer, the residual stream entering it at the full-depth positions (anchors,
the deep suffix, the continuation). Cutoff `c` then only runs layers c..L-1 on those few rows,
visible to each other as `SpeedRule` says, as the dense reference does. The cost is
one forward over P + K tokens plus, per layer, one batched call over A + D + K rows for every
cutoff at or below it, instead of about L / 2 full forwards.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from speedkv.analysis.dense import speed_hidden
from speedkv.core.flops import decode_flops, prefill_flops
from speedkv.errors import UserError
from speedkv.hf.backbone import Backbone, ModelShape
from speedkv.methods.speed import SpeedRule
from speedkv.prompts.builders import raw_passage
from speedkv.prompts.haystack import sentence_count

# budget metric -> (direction, allowed range text, check of the threshold)
BUDGETS: dict[str, tuple[str, str, Callable[[float], bool]]] = {
    "agreement": (">=", "in (0, 1]", lambda v: 0 < v <= 1),
    "ppl_ratio": ("<=", "at least 1", lambda v: v >= 1),
    "kl": ("<=", "at least 0", lambda v: v >= 0),
}
BUDGET_HELP = "agreement=0.95, ppl_ratio=1.05 or kl=0.05 (several joined by commas all apply)"


def parse_budget(text: str) -> dict[str, float]:
    """'agreement=0.95' or 'agreement=0.95,ppl_ratio=1.05' -> {metric: threshold}."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        name, sep, raw = part.partition("=")
        name = name.strip()
        if not sep or name not in BUDGETS:
            raise UserError(f"budget '{text}' is not understood; use {BUDGET_HELP}")
        try:
            value = float(raw)
        except ValueError:
            raise UserError(f"budget value '{raw.strip()}' for {name} is not a number") from None
        _, allowed, ok = BUDGETS[name]
        if not math.isfinite(value) or not ok(value):
            raise UserError(f"the {name} budget must be {allowed}, got {raw.strip()}")
        out[name] = value
    return out


def parse_candidates(text: str, num_layers: int) -> list[int]:
    """'0..30', '16..30', '18,20,22' or a mix ('4,16..30') -> sorted distinct cutoffs."""
    found: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        low, dots, high = part.partition("..")
        try:
            values = range(int(low), int(high) + 1) if dots else [int(part)]
        except ValueError:
            raise UserError(
                f"candidates must be cutoffs like '0..{num_layers}' or '18,20,22', got '{text}'"
            ) from None
        if not values or min(values) < 0 or max(values) > num_layers:
            raise UserError(
                f"candidate cutoffs must lie in 0..{num_layers} for this model, got '{part}'"
            )
        found.update(values)
    return sorted(found)


def meets(row: dict, budget: dict[str, float]) -> bool:
    for name, threshold in budget.items():
        if BUDGETS[name][0] == ">=" and not row[name] >= threshold:
            return False
        if BUDGETS[name][0] == "<=" and not row[name] <= threshold:
            return False
    return True


def smallest_meeting(rows: dict[int, dict], budget: dict[str, float]) -> int | None:
    """The smallest cutoff from which every larger candidate meets the budget too (fidelity is
    not exactly monotone in the cutoff; a lucky low cutoff below a failing one is not
    trusted). None when even the largest candidate fails."""
    chosen = None
    for cut in sorted(rows, reverse=True):
        if not meets(rows[cut], budget):
            break
        chosen = cut
    return chosen


# -- per-cutoff logits ------------------------------------------------------------------------
@torch.inference_mode()
def full_depth_streams(
    backbone: Backbone, ids: torch.Tensor, prompt_len: int, rule: SpeedRule
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One full-attention pass over `ids`; returns the residual stream entering every layer
    (and leaving the last) at the rule's full-depth positions, [L + 1] x [1, m, H], and those
    positions [m]."""
    ids = ids.reshape(1, -1).to(backbone.device)
    pos = torch.arange(ids.shape[1], device=ids.device)
    keep = rule.full_depth(pos, prompt_len, rule.deep_tokens(None))
    shape = backbone.shape
    # below any cutoff: full attention (within each layer's sliding window, if it has one)
    masks = {w: rule.visibility(0, pos, pos, w)[None, None] for w in set(shape.windows) or {None}}
    h = backbone.embed(ids)
    streams = [h[:, keep]]
    for layer in range(shape.num_layers):
        h = backbone.hf_layer(layer, h, masks[shape.window(layer)], pos)
        streams.append(h[:, keep])
    return streams, pos[keep]


@torch.inference_mode()
def upper_layers(
    backbone: Backbone,
    streams: list[torch.Tensor],
    positions: torch.Tensor,
    cutoffs: list[int],
    rule: SpeedRule,
) -> dict[int, torch.Tensor]:
    """Every cutoff's final hidden states [m, H] at the full-depth positions: cutoff `c` runs
    layers c..L-1 over the gathered rows, starting from the stream full attention left at
    layer `c`. The cutoffs ride as one batch: at layer l every cutoff <= l goes through it in
    a single call (L calls in all, not about L^2 / 2)."""
    shape = backbone.shape
    L = shape.num_layers
    masks = {
        w: rule.upper_visibility(positions, positions, w)[None, None]
        for w in set(shape.windows) or {None}
    }
    out = {cut: streams[L][0] for cut in cutoffs if cut == L}
    batch, members = None, []
    for layer in range(min(cutoffs), L):
        if layer in cutoffs:
            batch = streams[layer] if batch is None else torch.cat([batch, streams[layer]])
            members.append(layer)
        batch = backbone.hf_layer(layer, batch, masks[shape.window(layer)], positions)
    for row, cut in enumerate(members):
        out[cut] = batch[row]
    return out


def shared_logits(
    backbone: Backbone,
    ids: torch.Tensor,
    prompt_len: int,
    cutoffs: Iterable[int],
    anchors: int = 1,
    deep: int = 1,
) -> Iterable[tuple[int, torch.Tensor, torch.Tensor]]:
    """(cutoff, logits [m, vocab], positions [m]) for each cutoff, from one shared pass."""
    cutoffs = list(cutoffs)
    rule = SpeedRule(backbone.shape.num_layers, anchors, deep, window=backbone.shape.largest_window)
    streams, positions = full_depth_streams(backbone, ids, prompt_len, rule)
    finals = upper_layers(backbone, streams, positions, cutoffs, rule)
    del streams
    for cut in cutoffs:
        with torch.inference_mode():
            logits = backbone.logits(backbone.final_norm(finals[cut]))
        yield cut, logits, positions


@torch.inference_mode()
def separate_logits(
    backbone: Backbone,
    ids: torch.Tensor,
    prompt_len: int,
    cutoffs: Iterable[int],
    anchors: int = 1,
    deep: int = 1,
) -> Iterable[tuple[int, torch.Tensor, torch.Tensor]]:
    """The same, evaluating every cutoff on its own with the dense reference."""
    rule = SpeedRule(backbone.shape.num_layers, anchors, deep, window=backbone.shape.largest_window)
    for cut in cutoffs:
        h, positions = speed_hidden(backbone, ids, prompt_len, rule.at(cut))
        logits = backbone.logits(h)
        # the ordinary forward (cut == L) returns every position: keep the full-depth ones
        keep = rule.full_depth(positions, prompt_len, deep)
        yield cut, logits[keep], positions[keep]


# -- fidelity ---------------------------------------------------------------------------------
@dataclass
class Tally:
    """Running sums of one cutoff's comparison with full attention."""

    positions: int = 0
    agree: int = 0
    nll: float = 0.0
    nll_full: float = 0.0
    kl: float = 0.0

    def add(self, logits: torch.Tensor, full: torch.Tensor, targets: torch.Tensor) -> None:
        logp, logq = F.log_softmax(full, -1), F.log_softmax(logits, -1)
        self.positions += targets.numel()
        self.agree += int((logits.argmax(-1) == full.argmax(-1)).sum())
        self.nll += float(F.nll_loss(logq, targets, reduction="sum"))
        self.nll_full += float(F.nll_loss(logp, targets, reduction="sum"))
        self.kl += float((logp.exp() * (logp - logq)).sum())

    def row(self) -> dict:
        n = max(self.positions, 1)
        ppl, ppl_full = math.exp(self.nll / n), math.exp(self.nll_full / n)
        return {
            "agreement": self.agree / n,
            "ppl": ppl,
            "ppl_full": ppl_full,
            "ppl_ratio": ppl / ppl_full,
            "kl": self.kl / n,
            "positions": self.positions,
        }


@dataclass
class Sweep:
    """Every candidate cutoff's fidelity against full attention."""

    rows: dict[int, dict]
    seconds: float
    passages: int
    prompt_tokens: int
    new_tokens: int
    anchors: int
    deep: int
    shared: bool
    extra: dict = field(default_factory=dict)


def continuation_rows(positions: torch.Tensor, prompt_len: int, new_tokens: int) -> torch.Tensor:
    """Indices of the logit rows that predict the K continuation tokens: positions
    P-1 .. P+K-2."""
    wanted = (positions >= prompt_len - 1) & (positions < prompt_len + new_tokens - 1)
    return wanted.nonzero()[:, 0]


def sweep(
    backbone: Backbone,
    passages: list[list[int]],
    prompt_len: int,
    cutoffs: list[int],
    anchors: int = 1,
    deep: int = 1,
    shared: bool = True,
    progress: bool = True,
    reference: Backbone | None = None,
) -> Sweep:
    """Fidelity of SPEED at every cutoff in `cutoffs` on passages of P + K tokens (the first
    `prompt_len` are the prompt). `shared` uses one pass per passage; otherwise each cutoff
    is computed on its own (the slow reference). Full attention of `reference` (the base
    model, when `backbone` carries an adapter) is what every cutoff is compared with;
    by default it is `backbone`'s own."""
    L = backbone.shape.num_layers
    if not passages:
        raise UserError("the cutoff sweep needs at least one passage")
    new_tokens = len(passages[0]) - prompt_len
    if new_tokens < 1 or any(len(p) != prompt_len + new_tokens for p in passages):
        raise UserError("every passage must hold the prompt plus the same number of tokens")
    if not 1 <= deep < prompt_len or anchors < 0 or anchors + deep > prompt_len:
        raise UserError(f"anchors and deep tokens must fit in the {prompt_len}-token prompt")
    tallies = {cut: Tally() for cut in cutoffs}
    produce = shared_logits if shared else separate_logits
    order = [L] + [c for c in cutoffs if c != L]  # full first: the reference for the rest
    bar = tqdm(
        total=len(passages) * len(order), disable=not progress, desc="choose-lcut", unit="cutoff"
    )
    start = time.perf_counter()
    for ids in passages:
        ids_t = torch.tensor(ids, dtype=torch.long)
        targets = ids_t[prompt_len:]
        full = None
        if reference is not None:
            _, logits, positions = next(produce(reference, ids_t, prompt_len, [L], anchors, deep))
            full = logits[continuation_rows(positions.cpu(), prompt_len, new_tokens)].cpu()
        for cut, logits, positions in produce(backbone, ids_t, prompt_len, order, anchors, deep):
            rows = logits[continuation_rows(positions.cpu(), prompt_len, new_tokens)].cpu()
            if full is None:
                full = rows
            if cut in tallies:
                tallies[cut].add(rows, full, targets)
            bar.update()
    bar.close()
    return Sweep(
        rows={cut: tallies[cut].row() for cut in cutoffs},
        seconds=time.perf_counter() - start,
        passages=len(passages),
        prompt_tokens=prompt_len,
        new_tokens=new_tokens,
        anchors=anchors,
        deep=deep,
        shared=shared,
    )


def calib_passages(
    tokenizer, n: int, prompt_len: int, new_tokens: int, split: str = "calib"
) -> list[list[int]]:
    """`n` passages of exactly prompt_len + new_tokens tokens of raw essay text from `split`
    (calibration by default: never used for evaluation or training), spread over its text."""
    count = sentence_count(split)
    total = prompt_len + new_tokens
    return [raw_passage(tokenizer, total, split, i * count // n) for i in range(n)]


# -- cost model -------------------------------------------------------------------------------
def expected_savings(
    shape: ModelShape, lcut: int, context: int, anchors: int = 1, deep: int = 1
) -> dict:
    """SPEED at `lcut` against full attention on a `context`-token prompt, from the analytic
    cost model (speedkv.flops): prefill FLOPs (the TTFT proxy), KV entries at the first new
    token, and one decode step's FLOPs (weights plus reading the cache)."""
    L, n = shape.num_layers, context
    deep_rows = min(n, anchors + deep)
    upper = L - lcut
    full_prefill = prefill_flops(shape, [n] * L, [n * (n + 1) // 2] * L)
    speed_prefill = prefill_flops(
        shape,
        [n] * lcut + [deep_rows] * upper,
        [n * (n + 1) // 2] * lcut + [deep_rows * (deep_rows + 1) // 2] * upper,
    )
    kv_full, kv_speed = L * n, lcut * n + upper * deep_rows
    # one decode step reads every cached entry plus its own
    step_full = decode_flops(shape, kv_full + L, 1)
    step_speed = decode_flops(shape, kv_speed + L, 1)
    return {
        "context": n,
        "ttft_ratio": speed_prefill / full_prefill,
        "kv_ratio": kv_speed / kv_full,
        "decode_flops_ratio": step_speed / step_full,
        "ttft_saving": 1 - speed_prefill / full_prefill,
        "kv_saving": 1 - kv_speed / kv_full,
    }
