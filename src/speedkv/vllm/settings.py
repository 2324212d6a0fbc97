"""SPEED's settings as vLLM carries them: flat `speedkv_*` keys on the model's HF config.

`hf_overrides` puts them there in the front end; vLLM ships that config to the engine core and
the workers, so every process reads the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

# vLLM architecture name of each model type the plugin runs
ARCHITECTURES = {
    "llama": "SpeedLlamaForCausalLM",
    "mistral": "SpeedMistralForCausalLM",
    "qwen2": "SpeedQwen2ForCausalLM",
    "qwen3": "SpeedQwen3ForCausalLM",
    "gemma3_text": "SpeedGemma3ForCausalLM",
}


@dataclass(frozen=True)
class SpeedSettings:
    lcut: int  # layers every prompt token runs
    anchors: int  # leading positions kept at full depth
    deep: int  # last prompt tokens kept at full depth
    # the upper layers hold blocks for their full-depth rows only (kv_spec.py); False keeps
    # vLLM's stock allocation: every layer holds blocks for every token
    compact_kv: bool = True

    def hf_overrides(self, model_type: str) -> dict[str, Any]:
        return {
            "architectures": [ARCHITECTURES[model_type]],
            "speedkv_lcut": self.lcut,
            "speedkv_anchors": self.anchors,
            "speedkv_deep": self.deep,
            "speedkv_compact_kv": self.compact_kv,
        }

    def kv_kinds(self, layers: int, windows: Sequence[int | None] = ()) -> list[tuple[bool, bool]]:
        """Each layer's KV kind as vLLM tells them apart: (an upper layer with its own blocks,
        windowed). `windows`: each layer's sliding window (`ModelShape.windows`), or ()."""
        upper_own = self.compact_kv and 0 < self.lcut < layers
        return [
            (upper_own and layer >= self.lcut, bool(windows) and windows[layer] is not None)
            for layer in range(layers)
        ]

    def kv_groups(self, layers: int) -> tuple[int, int, int]:
        """(layers per group, lower groups, upper groups) on a model without a window
        (`group_layers`)."""
        groups = self.group_layers(layers)
        upper = sum(group[0] >= self.lcut for group in groups) if len(groups) > 1 else 0
        return len(groups[0]), len(groups) - upper, upper

    def group_layers(self, layers: int, windows: Sequence[int | None] = ()) -> list[list[int]]:
        """The layers of each KV cache group of one shared block pool, as vLLM 0.32 makes them
        (`_get_kv_cache_groups_uniform_page_size`). Layers of one kind (`kv_kinds`) go to
        groups of equal size: the smallest kind's layer count, or the largest's when all are
        within 1.5x of it; a kind's last group is padded, and padding costs memory. A kind's
        layers are dealt round-robin (group i holds layers i, i + n, ...), so every pipeline
        stage gets a share of every group."""
        kinds: dict[tuple[bool, bool], list[int]] = {}
        for layer, kind in enumerate(self.kv_kinds(layers, windows)):
            kinds.setdefault(kind, []).append(layer)
        counts = [len(kind) for kind in kinds.values()]
        size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
        return [
            kind[i::n] for kind in kinds.values() for n in [-(-len(kind) // size)] for i in range(n)
        ]

    def stage_slots(self, layers: int, stages: list[tuple[int, int]],
                    windows: Sequence[int | None] = ()) -> list[int]:  # fmt: skip
        """Layer slots one block of the shared pool costs on each pipeline stage (the layers
        `[start, end)` of each): vLLM sizes a stage's block by its largest group there, and
        every group's blocks come from that one pool."""
        groups = self.group_layers(layers, windows)
        return [max(sum(start <= i < end for i in g) for g in groups) for start, end in stages]

    def compact_pays(self, layers: int, stages: list[tuple[int, int]]) -> bool:
        """Whether the upper layers' own blocks make a long request's KV smaller than stock
        blocks on these pipeline stages. A long prompt takes a block per `block_size` tokens
        in each lower group, each costing every stage its largest group there; stock blocks
        cost `layers` slots. With several stages that can cost more than it saves."""
        if not self.compact_kv or self.lcut in (0, layers):
            return False
        _, lower_groups, _ = self.kv_groups(layers)
        return lower_groups * sum(self.stage_slots(layers, stages)) < layers

    def padded_layers(self, layers: int, stages: list[tuple[int, int]] | None = None,
                      windows: Sequence[int | None] = ()) -> int:  # fmt: skip
        """Layer slots vLLM's grouping pads (memory reserved for no layer), over all stages."""
        stages = stages or [(0, layers)]
        groups = len(self.group_layers(layers, windows))
        return sum(self.stage_slots(layers, stages, windows)) * groups - layers

    @classmethod
    def from_overrides(cls, overrides: dict[str, Any] | None) -> SpeedSettings | None:
        """The settings in a set of hf_overrides; None when they select no SPEED model."""
        if not overrides or "speedkv_lcut" not in overrides:
            return None
        return cls.from_hf_config(SimpleNamespace(**overrides))

    @classmethod
    def from_hf_config(cls, config: Any) -> SpeedSettings:
        missing = [
            k
            for k in ("speedkv_lcut", "speedkv_anchors", "speedkv_deep")
            if getattr(config, k, None) is None
        ]
        if missing:
            raise ValueError(
                f"a SPEED architecture needs {', '.join(missing)} in hf_overrides; build the "
                "engine arguments with speedkv.vllm.engine_args(method, model)"
            )
        return cls(
            int(config.speedkv_lcut),
            int(config.speedkv_anchors),
            int(config.speedkv_deep),
            bool(getattr(config, "speedkv_compact_kv", True)),
        )


def rank_split(lcut: int, start: int, end: int) -> tuple[range, range]:
    """The layers `[start, end)` of one pipeline rank, split at the cut: the lower ones run
    every row of a step, the upper ones the full-depth rows. A rank wholly below the cut has
    no upper layers, one wholly above it no lower layers."""
    split = min(max(lcut, start), end)
    return range(start, split), range(split, end)


def padding_free_lcut(layers: int, windows: Sequence[int | None] = (),
                      target: float = 0.75) -> int:  # fmt: skip
    """The cutoff nearest `target * layers` whose KV cache groups need no padding in vLLM
    (the deeper one on a tie): the vLLM backend's default lcut."""
    free = [
        c for c in range(1, layers)
        if SpeedSettings(c, 1, 1).padded_layers(layers, windows=windows) == 0
    ]  # fmt: skip
    return min(free, key=lambda c: (abs(c - target * layers), -c))
