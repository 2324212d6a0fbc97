"""StreamingLLM (Xiao et al.): attention sinks plus a window of recent tokens.

Every layer keeps the first `sink` positions and the most recent `window` entries, after
prefill and after every decode step. `window` is a whole token count (a fixed cap: the cache
never grows past `sink + window`) or a fraction in (0, 1] of the tokens seen so far (prompt
and generated, so `window=1` never evicts). Prefill attention itself is full. Keys keep their
original positions (as the KV-compression baselines in FastKV's and kvpress's code do; the
streaming paper re-numbers positions inside the cache for unbounded streams).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speedkv.core.policy import LayerView, Policy, PromptInfo
from speedkv.core.registry import register
from speedkv.errors import UserError
from speedkv.methods.scoring import budget, check_budget


@register
class StreamingLLM(Policy):
    name = "streamingllm"
    degenerate_specs = ("streamingllm:window=1", "streamingllm:sink=0,window={T}")

    @dataclass
    class Config:
        sink: int = 4
        window: float = 1020

    def __init__(self, config: Config, shape):
        super().__init__(config, shape)
        if config.sink < 0:
            raise UserError(f"sink must be >= 0, got {config.sink}")
        check_budget(config.window, "window")
        self.recent = 0

    def begin(self, prompt: PromptInfo) -> None:
        self.recent = self.window(prompt.n)

    def window(self, seen: int) -> int:
        return max(1, budget(self.config.window, seen, "window"))

    def kept(self, layer: int, view: LayerView) -> torch.Tensor | None:
        pos = view.kv.positions()[0]
        n = pos.numel()
        if n <= self.config.sink + self.recent:
            return None
        keep = pos < self.config.sink
        keep[n - self.recent :] = True
        return keep

    def after_decode(self, layer: int, q: torch.Tensor, kv) -> None:
        sink = self.config.sink
        seen = int(kv.pos[0, kv.length - 1]) + 1  # the token just written is the newest
        if kv.length > sink + self.window(seen):
            pos = kv.positions()[0].clone()
            pos[pos < sink] = torch.iinfo(pos.dtype).max  # sinks are never evicted
            oldest = torch.argmin(pos)
            kv.evict(oldest.expand(kv.k.shape[0]))

    def summary(self) -> dict:
        return {"sink": self.config.sink, "window_after_prefill": self.recent}
