"""SwiftKV (Qiao et al.), training-free SingleInputKV, with optional AcrossKV.

Pick a layer `k`. The residual entering layer k, normed by layer k's input norm, is the single
input from which every layer `l >= k` projects its K/V (`K_l = RoPE(Wk_l x)`, `V_l = Wv_l x`),
for prompt and decode tokens alike. Prompt tokens other than the last stop at layer k; only
the last prompt token and decode tokens run the later layers' queries, attention and MLPs.
The trained method learns these projections; the training-free baseline implemented here
initialises them from the original weights, as the authors' own baseline does.

AcrossKV (`acrosskv=G`): layers `>= k` share one KV cache per group of G consecutive layers,
projected with the first layer of the group, so the cache above k shrinks G-fold.

Default `k`: 16 of Llama-3.1-8B's 32 layers, scaled by depth (`round(16 * L / 32)`).
"""

from __future__ import annotations

from dataclasses import dataclass

from speedkv.core.registry import register
from speedkv.errors import UserError
from speedkv.methods.common import LastTokenContinues


@register
class SwiftKV(LastTokenContinues):
    name = "swiftkv"
    degenerate_specs = ("swiftkv:k={L}", "swiftkv:k={L},acrosskv=2")

    @dataclass
    class Config:
        k: int | None = None
        acrosskv: int = 1

    def __init__(self, config: Config, shape):
        super().__init__(config, shape)
        layers = shape.num_layers
        if config.k is None:
            config.k = round(16 * layers / 32)
        if not 0 <= config.k <= layers:
            raise UserError(f"k must be between 0 and {layers} for this model, got {config.k}")
        if config.acrosskv < 1:
            raise UserError(f"acrosskv must be a group size >= 1, got {config.acrosskv}")

    def cut_layer(self) -> int:
        return self.config.k

    def exited_kv(self, layer: int) -> int | None:
        return self.config.k if layer >= self.config.k else None

    def kv_input(self, layer: int) -> tuple[int, int] | None:
        return (self.config.k, self.config.k) if layer >= self.config.k else None

    def kv_owner(self, layer: int) -> int:
        k, group = self.config.k, self.config.acrosskv
        return layer if layer < k else k + (layer - k) // group * group
