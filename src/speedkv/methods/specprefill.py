"""SpecPrefill (Liu et al.): a speculator's attention picks the prompt chunks to prefill.

The speculator runs the prompt, keeping the post-rotary query of the last prompt token in every
layer, then greedily decodes `look_ahead - 1` more tokens, keeping their queries too (steps
after EOS are dropped). For every kept query, layer and head: softmax over the prompt keys;
average-pool along tokens (kernel `pool`), take the max over layers and heads, then the mean
over look-ahead steps. The prompt is cut into chunks of `chunk` tokens and the
`ceil(chunks * keep)` chunks with the best mean score are kept, in order. The main model
prefills only those tokens, at their ORIGINAL positions, and decoding continues from the
original prompt length. `force_last=K` also keeps the last K prompt tokens (the reference
does not; it helps when the question sits at the end).

The speculator (`speculator=`):
- `self:K` -- the main model's own first K layers with its final norm and head (early exit).
  Beyond the reference: it needs no second model, so the method works for any checkpoint.
- an embedded model name, an HF directory or a GGUF file -- a smaller model. If its tokenizer
  differs from the main model's (beyond the reference too), each main token takes the best
  score of the speculator tokens overlapping its characters.
`speculator=self` means the first quarter of the layers. Defaults: keep 10%, look-ahead 8,
chunks of 32, pooling kernel 13 (the authors').
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from speedkv.core.policy import Policy, PromptInfo, Selection
from speedkv.core.registry import register
from speedkv.errors import UserError
from speedkv.methods.probe import record, step_queries
from speedkv.methods.scoring import attention_probs, check_budget, pool1d


@register
class SpecPrefill(Policy):
    name = "specprefill"
    degenerate_specs = ("specprefill:keep=1",)

    @dataclass
    class Config:
        keep: float = 0.1
        look_ahead: int = 8
        chunk: int = 32
        pool: int = 13
        speculator: str = "self"
        force_last: int = 0

    def __init__(self, config: Config, shape):
        super().__init__(config, shape)
        check_budget(config.keep, "keep")
        if config.keep > 1:
            raise UserError(f"keep is a fraction of chunks in (0, 1], got {config.keep:g}")
        if config.look_ahead < 1 or config.chunk < 1 or config.pool < 1 or config.force_last < 0:
            raise UserError("look_ahead, chunk and pool must be >= 1 and force_last >= 0")
        if config.speculator == "self":
            config.speculator = f"self:{max(1, round(shape.num_layers / 4))}"
        if config.speculator.startswith("self:"):
            depth = config.speculator[5:]
            if not depth.isdigit() or not 1 <= int(depth) <= shape.num_layers:
                raise UserError(
                    f"speculator self:K needs K between 1 and {shape.num_layers}, got '{depth}'"
                )
        self.n = 0
        self.kept_tokens = 0

    def select_prompt(self, prompt: PromptInfo, engine) -> Selection | None:
        cfg = self.config
        self.n = self.kept_tokens = prompt.n
        chunks = math.ceil(prompt.n / cfg.chunk)
        keep_chunks = math.ceil(chunks * cfg.keep)
        if keep_chunks >= chunks:
            return None
        scores = self.token_scores(prompt.ids, engine)
        padded = torch.zeros(chunks * cfg.chunk, device=scores.device)
        padded[: prompt.n] = scores
        counts = torch.full((chunks,), float(cfg.chunk), device=scores.device)
        counts[-1] = prompt.n - (chunks - 1) * cfg.chunk
        chunk_scores = padded.view(chunks, cfg.chunk).sum(1) / counts
        best = torch.topk(chunk_scores, keep_chunks).indices
        keep = torch.zeros(chunks * cfg.chunk, dtype=torch.bool, device=scores.device)
        keep.view(chunks, cfg.chunk)[best] = True
        keep = keep[: prompt.n]
        if cfg.force_last:
            keep[-cfg.force_last :] = True
        chosen = keep.nonzero()[:, 0]
        self.kept_tokens = chosen.numel()
        return Selection(chosen, prompt.positions[chosen], prompt.n)

    def token_scores(self, ids: torch.Tensor, engine) -> torch.Tensor:
        """Max-over-layers-and-heads, mean-over-steps attention of the speculator ([n])."""
        speculator, same_tokens = self._speculator(engine)
        text_ids = ids if same_tokens else None
        if not same_tokens:
            spans, spec_ids = _char_alignment(engine.tokenizer, speculator.tokenizer, ids)
            text_ids = torch.tensor(spec_ids, device=speculator.device)
        layers = set(range(speculator.depth))
        recorder, _ = record(
            speculator, text_ids, layers, self.config.look_ahead, speculator.eos_ids
        )
        steps = len(step_queries(recorder, 0))
        per_step = torch.full((steps, text_ids.numel()), float("-inf"), device=ids.device)
        for layer in layers:
            keys = recorder.prompt_keys[layer]
            for s, q in enumerate(step_queries(recorder, layer)):
                probs = attention_probs(q, None, keys, None)[:, 0]  # [Hq, n], all earlier
                probs = pool1d(probs, self.config.pool, "avg")
                per_step[s] = torch.maximum(per_step[s], probs.max(0).values)
        scores = per_step.mean(0)
        if same_tokens:
            return scores
        return _spread(scores, spans, ids.numel())

    def external_models(self) -> list[str]:
        speculator = self.config.speculator
        return [] if speculator.startswith("self:") else [speculator]

    def _speculator(self, engine):
        """(engine for the speculator, whether it tokenises exactly like the main model)."""
        name = self.config.speculator
        if name.startswith("self:"):
            return engine.with_depth(int(name[5:])), True
        speculator = engine.companion(name)
        same = speculator.tokenizer.get_vocab() == engine.tokenizer.get_vocab()
        return speculator, same

    def summary(self) -> dict:
        return {"prompt_tokens": self.n, "kept": self.kept_tokens}


def _char_alignment(main_tok, spec_tok, ids: torch.Tensor):
    """Character span of every main token in the prompt text, and the speculator's ids with
    their spans: [(start, end)] per main token, then (spec_ids, spec_spans)."""
    pieces = [main_tok.decode([int(i)], skip_special_tokens=False) for i in ids.tolist()]
    spans, at = [], 0
    for piece in pieces:
        spans.append((at, at + len(piece)))
        at += len(piece)
    text = "".join(pieces)
    enc = spec_tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return (spans, enc["offset_mapping"]), enc["input_ids"]


def _spread(spec_scores: torch.Tensor, alignment, n: int) -> torch.Tensor:
    """Main-token scores: the best score of the speculator tokens overlapping each one."""
    main_spans, spec_spans = alignment
    out = torch.zeros(n, device=spec_scores.device)
    j = 0
    for i, (start, end) in enumerate(main_spans):
        while j < len(spec_spans) and spec_spans[j][1] <= start:
            j += 1
        k, best = j, 0.0
        while k < len(spec_spans) and spec_spans[k][0] < max(end, start + 1):
            best = max(best, float(spec_scores[k]))
            k += 1
        out[i] = best
    return out
