"""Choosing the next token: greedy, or temperature / top-k / top-p sampling with a seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speedkv.errors import UserError


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> SamplingParams:
        if self.max_new_tokens < 1:
            raise UserError(f"max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise UserError(f"temperature must be between 0 and 100, got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"top-k must be 0 (off) or a positive count, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top-p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise UserError("stop strings must not be empty")
        return self

    @property
    def greedy(self) -> bool:
        # temperatures this small divide logits into overflow; they mean greedy anyway
        return self.temperature < 1e-5


class Sampler:
    """Per-sequence sampler: its own generator, so a batch samples exactly like one-by-one runs."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [vocab] float32 on any device -> chosen token id."""
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits.float().cpu() / p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            ordered, order = torch.sort(logits, descending=True)
            cumulative = torch.softmax(ordered, -1).cumsum(-1)
            # drop a token once the mass before it already reaches top_p (keep at least one)
            drop = (cumulative - torch.softmax(ordered, -1)) >= p.top_p
            drop[0] = False  # the likeliest token always stays, however small top_p is
            logits = logits.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(logits, -1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
