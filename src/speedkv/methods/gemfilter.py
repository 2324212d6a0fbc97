"""GemFilter (Shi et al.): an early layer picks the prompt tokens; the model reruns on them.

The model runs only up to `filter_layer` on the whole prompt. There every token is scored by
its key's dot product with the last prompt token's query (after rotary, no softmax, no
scaling), summed over query heads (each with its KV head) and average-pooled with kernel 5.
The top `retain` tokens (a fraction, or a whole count), in prompt order, are then prefilled
by the whole model as if they were the prompt: at NEW positions 0..k-1, as the reference
does. Decoding continues from position k. The first pass costs `filter_layer + 1` layers of
a full prefill and shows in TTFT.

Defaults: the authors' 13th of 32 layers, scaled by depth (12 of 30 for SmolLM2), and their
budget of 1024 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speedkv.core.policy import Policy, PromptInfo, Selection
from speedkv.core.registry import register
from speedkv.errors import UserError
from speedkv.methods.common import resolve_layer
from speedkv.methods.probe import record
from speedkv.methods.scoring import budget, check_budget, pool1d


@register
class GemFilter(Policy):
    name = "gemfilter"
    degenerate_specs = ("gemfilter:retain=1,filter_layer=5",)

    @dataclass
    class Config:
        filter_layer: int | None = None
        retain: float = 1024
        kernel: int = 5

    def __init__(self, config: Config, shape):
        super().__init__(config, shape)
        config.filter_layer = resolve_layer(config.filter_layer, 13, shape, "filter_layer")
        check_budget(config.retain, "retain")
        if config.kernel < 1:
            raise UserError("kernel must be at least 1")
        self.kept_tokens = 0
        self.n = 0

    def select_prompt(self, prompt: PromptInfo, engine) -> Selection | None:
        self.n = prompt.n
        keep = budget(self.config.retain, prompt.n, "retain")
        self.kept_tokens = keep
        if keep >= prompt.n:
            return None
        scores = self.token_scores(prompt.ids, engine)
        chosen = torch.topk(scores, keep).indices.sort().values
        return Selection(chosen, torch.arange(keep, device=chosen.device), keep)

    def token_scores(self, ids: torch.Tensor, engine) -> torch.Tensor:
        """Pooled q_last . k at the filter layer, one score per prompt token ([n])."""
        layer = self.config.filter_layer
        recorder, _ = record(engine.with_depth(layer + 1), ids, {layer})
        q, keys = recorder.prompt_queries[layer], recorder.prompt_keys[layer]  # [Hq,1,D], [Hkv,n,D]
        group = q.shape[0] // keys.shape[0]
        dots = torch.matmul(q.float(), keys.float().repeat_interleave(group, 0).transpose(1, 2))
        return pool1d(dots[:, 0].sum(0), self.config.kernel, "avg")

    def summary(self) -> dict:
        return {"prompt_tokens": self.n, "kept": self.kept_tokens}
