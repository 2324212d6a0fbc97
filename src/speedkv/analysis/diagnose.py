"""The layer-wise cutoff diagnostic (SPEED, §4 "Layer-wise cutoff diagnostic" and §5.3).

During greedy decode, per layer and per generated token:

- attention mass from the generated token to the prefill tokens (prompt positions 1..P-2),
  to the last prompt token (kept apart: SPEED keeps it at full depth), to the BoS token
  (position 0), to earlier generated tokens, and to itself, each averaged over query heads
  (the five add up to 1);
- conditional prompt entropy: the entropy of the token's attention restricted to the prefill
  tokens and renormalised over them, divided by log(number of prefill tokens) so prompts of
  different lengths compare (0 = all on one token, 1 = uniform);
- trajectory curvature of the residual stream across depth: the angle between successive
  layer updates h_{l+1} - h_l and h_l - h_{l-1} (small = the layers keep pushing one way,
  the representation has settled);
- token-trajectory curvature per layer (Hosseini & Fedorenko, 2023): the angle between
  successive steps x_{t+1} - x_t of the generated tokens' states within one layer.

The residual stream is computed by transformers' own layers (`Backbone.hf_layer`), so the
diagnostic shares no attention code with the engine; the attention weights are recomputed
from the layer's own queries and keys, for the generated rows only. A trace under SPEED
visibility follows `SpeedRule`: it gathers the full-depth rows at `lcut`, as the dense
reference does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from speedkv.core.engine import Engine, Request
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.hf.backbone import Backbone
from speedkv.hf.text import encode_prompt
from speedkv.methods.scoring import attention_probs
from speedkv.methods.speed import SpeedRule
from speedkv.prompts.builders import passage_prompt
from speedkv.prompts.haystack import haystack_text, sentence_count

CATEGORIES = ("prefill", "prompt_end", "bos", "decode", "self")


@dataclass
class PromptTrace:
    """Per-layer signals of one prompt's generated tokens under one visibility rule."""

    prompt_len: int
    steps: int  # generated tokens traced
    mass: dict[str, torch.Tensor]  # category -> [L, steps], mean over heads
    entropy: torch.Tensor  # [L, steps] normalised prompt entropy (nan: < 2 prefill keys seen)
    depth_curvature: torch.Tensor  # [L + 1, steps] degrees at the state entering each layer
    token_curvature: torch.Tensor  # [L + 1] mean degrees along the generated tokens
    logits: torch.Tensor  # [steps, vocab] float32 at the generated positions


def attention_weights(
    backbone: Backbone,
    layer: int,
    h: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    window: int | None = None,
) -> torch.Tensor:
    """Softmax attention of the stream rows `rows` over every stream position visible to them
    (causal by position, inside the layer's sliding `window` if it has one), float32
    [Hq, len(rows), n]. h: [n, H], the layer's input."""
    x = backbone.input_norm(layer, h)
    cos, sin = backbone.rope(positions)
    k, _ = backbone.kv(layer, x, cos, sin)
    q = backbone.q(layer, x[rows], cos[rows], sin[rows])
    return attention_probs(q, positions[rows], k, positions, window=window)


def key_categories(q_pos: torch.Tensor, k_pos: torch.Tensor, prompt_len: int) -> dict:
    """Bool [queries, keys] per category: prefill (prompt positions 1..P-2), the last prompt
    token (which SPEED keeps at full depth, like a decode token), BoS (position 0), earlier
    generated tokens, the query itself."""
    k, q = k_pos[None, :], q_pos[:, None]
    return {
        "prefill": (k >= 1) & (k < prompt_len - 1) & (k < q),
        "prompt_end": (k == prompt_len - 1) & (k > 0) & (k < q),
        "bos": (k == 0) & (q > 0),
        "decode": (k >= prompt_len) & (k < q),
        "self": k == q,
    }


def prompt_entropy(probs: torch.Tensor, prefill: torch.Tensor) -> torch.Tensor:
    """Entropy of attention restricted to and renormalised over the prefill keys, divided by
    the log of how many prefill keys each query sees. probs [Hq, g, n], prefill [g, n] ->
    [Hq, g]; nan where a query sees fewer than two prefill keys."""
    restricted = probs * prefill
    total = restricted.sum(-1, keepdim=True)
    p = restricted / total.clamp_min(1e-30)
    entropy = -torch.special.xlogy(p, p).sum(-1)
    count = prefill.sum(-1).float()
    normalised = entropy / count.clamp_min(2).log()
    return torch.where(count >= 2, normalised, torch.full_like(normalised, float("nan")))


def angles(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Angle in degrees between vectors along the last dimension (float64: arccos near 0
    degrees needs it)."""
    cos = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1, eps=1e-12)
    return torch.rad2deg(torch.arccos(cos.clamp(-1.0, 1.0))).float()


def depth_curvature(states: torch.Tensor) -> torch.Tensor:
    """states [L + 1, g, H] (the stream entering each layer, then the last layer's output)
    -> [L + 1, g]: at index l the angle between the updates of layers l - 1 and l; nan at the
    ends, where a state has no update on one side."""
    updates = states[1:] - states[:-1]
    out = torch.full(states.shape[:2], float("nan"))
    out[1:-1] = angles(updates[:-1], updates[1:])
    return out


def token_curvature(states: torch.Tensor) -> torch.Tensor:
    """states [L + 1, g, H] -> [L + 1]: per layer, the mean angle between successive steps of
    the generated tokens' trajectory (nan with fewer than three tokens)."""
    if states.shape[1] < 3:
        return torch.full(states.shape[:1], float("nan"))
    steps = states[:, 1:] - states[:, :-1]
    return angles(steps[:, :-1], steps[:, 1:]).mean(-1)


@torch.inference_mode()
def trace(
    backbone: Backbone,
    ids: list[int] | torch.Tensor,
    prompt_len: int,
    lcut: int | None = None,
    anchors: int = 1,
    deep: int = 1,
) -> PromptTrace:
    """Teacher-force prompt + generated tokens (`ids`) in one dense pass and measure every
    generated token's attention and residual trajectory in every layer.

    lcut None (or L) is full attention; otherwise SPEED visibility: from layer `lcut` on only
    the anchors, the last `deep` prompt tokens and the generated tokens stay in the stream.
    """
    num_layers = backbone.shape.num_layers
    lcut = num_layers if lcut is None else lcut
    rule = SpeedRule(lcut, anchors, deep, window=backbone.shape.largest_window)
    ids = torch.as_tensor(ids, dtype=torch.long, device=backbone.device).flatten()
    pos = torch.arange(ids.numel(), device=ids.device)
    h = backbone.embed(ids[None])
    mass = {c: [] for c in CATEGORIES}
    entropy, states = [], []
    for layer in range(num_layers):
        if layer == lcut:
            keep = rule.full_depth(pos, prompt_len, deep)
            h, pos = h[:, keep], pos[keep]
        rows = (pos >= prompt_len).nonzero()[:, 0]
        states.append(h[0, rows].float())
        window = backbone.shape.window(layer)
        probs = attention_weights(backbone, layer, h[0], pos, rows, window)
        groups = key_categories(pos[rows], pos, prompt_len)
        for name, where in groups.items():
            mass[name].append((probs * where).sum(-1).mean(0))
        entropy.append(prompt_entropy(probs, groups["prefill"]).mean(0))
        h = backbone.hf_layer(layer, h, rule.visibility(layer, pos, pos, window)[None, None], pos)
    states.append(h[0, rows].float())
    stack = torch.stack(states).cpu()
    return PromptTrace(
        prompt_len=prompt_len,
        steps=int(rows.numel()),
        mass={name: torch.stack(rows_).cpu() for name, rows_ in mass.items()},
        entropy=torch.stack(entropy).cpu(),
        depth_curvature=depth_curvature(stack),
        token_curvature=token_curvature(stack),
        logits=backbone.logits(backbone.final_norm(h[0, rows])).cpu(),
    )


# -- many prompts ------------------------------------------------------------------------------
class Signals:
    """One visibility rule's signals summed over prompts and generated tokens."""

    def __init__(self, num_layers: int, max_steps: int):
        L, S, f64 = num_layers, max_steps, torch.float64
        self.max_steps = max_steps
        self.tokens = 0
        self.mass = {c: torch.zeros(L, dtype=f64) for c in CATEGORIES}  # per-layer sums
        self.entropy, self.entropy_count = torch.zeros(L, dtype=f64), torch.zeros(L)
        self.depth, self.depth_count = torch.zeros(L + 1, dtype=f64), torch.zeros(L + 1)
        self.token, self.token_count = torch.zeros(L + 1, dtype=f64), torch.zeros(L + 1)
        self.heat = torch.zeros(L, S, dtype=f64)  # prefill mass per layer and step
        self.heat_count = torch.zeros(S)  # prompts reaching each step

    def add(self, t: PromptTrace) -> None:
        g = t.steps
        self.tokens += g
        for name in CATEGORIES:
            self.mass[name] += t.mass[name].sum(1).double()
        _add_finite(self.entropy, self.entropy_count, t.entropy)
        _add_finite(self.depth, self.depth_count, t.depth_curvature)
        _add_finite(self.token, self.token_count, t.token_curvature[:, None])
        self.heat[:, :g] += t.mass["prefill"][:, : self.max_steps].double()
        self.heat_count[:g] += 1

    def summary(self) -> dict:
        """Per-layer means (token-weighted) and the layer x step heatmap, as plain lists."""
        tokens = max(self.tokens, 1)
        heat = self.heat / self.heat_count.clamp_min(1)
        heat[:, self.heat_count == 0] = float("nan")
        return {
            "tokens": self.tokens,
            "attention": {name: _floats(v / tokens) for name, v in self.mass.items()},
            "prompt_entropy": _floats(self.entropy / self.entropy_count),
            "depth_curvature": _floats(self.depth / self.depth_count),
            "token_curvature": _floats(self.token / self.token_count),
            "heatmap_prefill": [_floats(row) for row in heat],
            "heatmap_prompts": [int(c) for c in self.heat_count],
        }


def _add_finite(total: torch.Tensor, count: torch.Tensor, values: torch.Tensor) -> None:
    """Add each layer's finite values [layers, k] to its running sum and count."""
    finite = torch.isfinite(values)
    total += torch.where(finite, values, torch.zeros_like(values)).sum(1).double()
    count += finite.sum(1)


def _floats(values: torch.Tensor) -> list[float | None]:
    return [None if not math.isfinite(v) else round(float(v), 6) for v in values.tolist()]


def greedy_continuations(
    engine: Engine, prompts: list[list[int]], specs: list[str], new_tokens: int, progress: bool
) -> dict[tuple[int, str], list[int]]:
    """Every prompt's own greedy continuation under every method, decoded as one batch
    through the engine; a final EOS is dropped (it is never fed back)."""
    requests, keys = [], []
    for index, ids in enumerate(prompts):
        for spec in specs:
            policy = make_policy(spec, engine.shape)
            requests.append(Request(list(ids), policy, SamplingParams(max_new_tokens=new_tokens)))
            keys.append((index, spec))
    out: dict[tuple[int, str], list[int]] = {key: [] for key in keys}
    bar = tqdm(total=len(requests) * new_tokens, disable=not progress, desc="generate", unit="tok")
    for event in engine.run(requests):
        tokens = out[keys[event.key]]
        if event.token_id not in engine.eos_ids:
            tokens.append(event.token_id)
        bar.update(new_tokens - len(tokens) if event.finished else 1)
    bar.close()
    return out


def diagnose(
    engine: Engine,
    prompts: list[list[int]],
    new_tokens: int,
    lcut: int,
    anchors: str | None = None,
    deep: int | None = None,
    progress: bool = True,
) -> dict:
    """Run every prompt greedily with full attention and with SPEED at `lcut`, trace each
    continuation under its own visibility, and summarise both. Returns a JSON-ready dict.
    `anchors` and `deep` None: SPEED's defaults."""
    spec = f"speed:lcut={lcut}" + (f",anchors={anchors}" if anchors else "")
    spec += f",deep={deep}" if deep is not None else ""
    speed = make_policy(spec, engine.shape)
    rule = SpeedRule.of(speed)
    deep = rule.deep_tokens(None)
    variants = {"full": ("full", None), "speed": (speed.spec(), lcut)}
    L = engine.shape.num_layers
    specs = [spec for spec, _ in variants.values()]
    continuations = greedy_continuations(engine, prompts, specs, new_tokens, progress)
    sums = {name: Signals(L, new_tokens) for name in variants}
    agreement = {name: [0, 0] for name in variants}
    generated: dict[str, list[int]] = {name: [] for name in variants}
    bar = tqdm(total=2 * len(prompts), disable=not progress, desc="trace", unit="run")
    for index, ids in enumerate(prompts):
        for name, (spec, cut) in variants.items():
            tokens = continuations[(index, spec)]
            generated[name].append(len(tokens))
            if tokens:
                t = trace(engine.backbone, ids + tokens, len(ids), cut, rule.anchors, deep)
                sums[name].add(t)
                # sanity: the dense trace predicts the engine's later greedy tokens
                predicted = t.logits[:-1].argmax(-1)
                agreement[name][0] += int((predicted == torch.tensor(tokens[1:])).sum())
                agreement[name][1] += len(tokens) - 1
            bar.update()
    bar.close()
    result = {
        "model_layers": L,
        "lcut": lcut,
        "speed_spec": speed.spec(),
        "prompts": len(prompts),
        "prompt_tokens": [len(ids) for ids in prompts],
        "new_tokens": new_tokens,
        "variants": {},
    }
    for name, (spec, _) in variants.items():
        summary = sums[name].summary()
        ok, total = agreement[name]
        summary.update(
            spec=spec,
            generated_tokens=generated[name],
            trace_engine_agreement=ok / total if total else None,
        )
        result["variants"][name] = summary
    result["candidates"] = candidate_cutoffs(result["variants"]["full"])
    return result


def candidate_cutoffs(full: dict, share: float = 0.9) -> dict[str, int]:
    """Cutoffs the full-attention signals point at (guides, not answers; docs/diagnose.md):

    - prefill_attention_90: the fewest lower layers that hold 90% of the decode-to-prefill
      attention mass summed over layers (the prompt-selection region);
    - straightening_90: the first layer whose input has completed 90% of the drop in
      token-trajectory curvature from the embeddings to its minimum (representation
      stabilisation).
    """
    out = {}
    percent = round(share * 100)
    prefill = [v or 0.0 for v in full["attention"]["prefill"]]
    total, running = sum(prefill), 0.0
    for layer, value in enumerate(prefill):
        running += value
        if total > 0 and running >= share * total - 1e-12:
            out[f"prefill_attention_{percent}"] = layer + 1
            break
    curve = full["token_curvature"]
    if all(v is not None for v in curve):
        low = min(curve)
        drop = curve[0] - low
        if drop > 0:
            out[f"straightening_{percent}"] = next(
                layer for layer, v in enumerate(curve) if curve[0] - v >= share * drop - 1e-12
            )
    return out


# -- built-in prompts -------------------------------------------------------------------------
INSTRUCTIONS = (
    "Explain why the sky is blue to a ten-year-old.",
    "Write a short poem about a lighthouse in winter.",
    "Give three tips for keeping a vegetable garden healthy.",
    "What are the main differences between a list and a tuple in Python?",
    "Describe the water cycle in a few sentences.",
    "Plan a one-day walking tour of an old harbour town.",
    "Summarise the causes of the French Revolution.",
    "How do vaccines train the immune system?",
)
DOC_QUESTIONS = (
    "What is the main argument of the passage above?",
    "Summarise the passage above in three sentences.",
    "List the key ideas of the passage above.",
    "What advice does the author give in the passage above?",
)


def default_prompts(tokenizer, n: int, doc_tokens: int) -> list[list[int]]:
    """`n` built-in chat prompts, alternating a short instruction and a question about a
    passage of about `doc_tokens` tokens of the calibration essays (never used by evaluation
    or training). Nothing is downloaded."""
    pool = sentence_count("calib")
    prompts = []
    for i in range(n):
        k = i // 2
        if i % 2 == 0:
            prompts.append(encode_prompt(tokenizer, INSTRUCTIONS[k % len(INSTRUCTIONS)]).ids)
            continue
        start = (k * 97) % pool  # spread passages over the calibration text
        doc = haystack_text(tokenizer, doc_tokens, split="calib", start=start)
        prompts.append(passage_prompt(tokenizer, doc, DOC_QUESTIONS[k % len(DOC_QUESTIONS)]))
    return prompts
