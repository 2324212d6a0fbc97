"""POP (He et al., 2026): prefill stops at `lcut`; decode stays full depth.

Prompt tokens run layers `< lcut` only. For every skipped layer `l >= lcut` they still get
K/V: layer l's own input norm and K/V projections applied to the frozen residual they left
with ("independent KV projections"); no attention or MLP runs for them there. The last prompt
token runs the whole model (boundary handling), and decode is ordinary full-depth decoding
over the full, partly synthesised cache. So TTFT falls like SPEED's while KV memory and TPOT
stay those of full attention.

Default `lcut`: the authors skip the last 10 of Llama-3.1-8B's 32 layers; scaled by depth,
`lcut = L - round(10 * L / 32)` (21 of 30 for SmolLM2).
"""

from __future__ import annotations

from dataclasses import dataclass

from speedkv.core.registry import register
from speedkv.errors import UserError
from speedkv.methods.common import LastTokenContinues


@register
class Pop(LastTokenContinues):
    name = "pop"
    degenerate_specs = ("pop:lcut={L}",)

    @dataclass
    class Config:
        lcut: int | None = None

    def __init__(self, config: Config, shape):
        super().__init__(config, shape)
        layers = shape.num_layers
        if config.lcut is None:
            config.lcut = layers - round(10 * layers / 32)
        if not 0 <= config.lcut <= layers:
            raise UserError(
                f"lcut must be between 0 and {layers} for this model, got {config.lcut}"
            )

    def cut_layer(self) -> int:
        return self.config.lcut

    def exited_kv(self, layer: int) -> int | None:
        return layer  # the skipped layer's own norm and projections
