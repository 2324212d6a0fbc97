"""The upper layers' own KV cache spec and manager: they hold blocks for SPEED's full-depth
rows only.

With the stock spec every layer gets blocks for every token, so the upper layers' compact rows
(`compact.py`) sit in a request's first blocks and the rest of its blocks stay empty. With this
spec the upper layers form KV cache groups of their own, and their manager gives a request
`ceil(compact length / block size)` blocks: about one block for a long prompt, where the lower
layers need `ceil(prompt / block size)`.

The manager learns each request's prompt length from `remove_skipped_blocks`, which vLLM calls
with it before every allocation. vLLM shares one block pool among groups of equal layer counts,
padding the smaller ones, so the saving is `lcut / L` only where the layer counts divide evenly
(docs/vllm.md).

Importing this module registers the spec with vLLM. The spec travels from the worker to the
engine core by pickling, so both processes import it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from speedkv.vllm.compact import full_depth_count


@dataclass(frozen=True, kw_only=True)
class SpeedUpperSpec(AttentionSpec):
    """An upper layer's KV: the full-depth rows of each request, in compact order."""

    speed_anchors: int = 1
    speed_deep: int = 1

    def compact_tokens(self, num_tokens: int, prompt_len: int) -> int:
        """Rows a request of `num_tokens` tokens keeps in this layer."""
        return full_depth_count(num_tokens, prompt_len, self.speed_anchors, self.speed_deep)

    def max_memory_usage_bytes(self, vllm_config) -> int:
        # a one-token prompt generating up to the context keeps every row
        return cdiv(vllm_config.model_config.max_model_len, self.block_size) * self.page_size_bytes

    @classmethod
    def merge(cls, specs: list[SpeedUpperSpec]) -> SpeedUpperSpec:
        first = specs[0]
        for spec in specs:
            for f in fields(cls):
                assert getattr(spec, f.name) == getattr(first, f.name), (
                    "every SPEED upper layer in a KV cache group has the same spec"
                )
        return first


class SpeedUpperManager(FullAttentionManager):
    """Allocates an upper group's blocks by compact length instead of token count."""

    def __init__(self, kv_cache_spec: SpeedUpperSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.prompt_lens: dict[str, int] = {}

    def remove_skipped_blocks(self, request_id, processed_computed_tokens,
                              num_prompt_tokens=None) -> None:  # fmt: skip
        if num_prompt_tokens is not None:
            self.prompt_lens[request_id] = num_prompt_tokens
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def _compact(self, request_id: str, num_tokens: int, fallback_prompt: int = 0) -> int:
        prompt = self.prompt_lens.get(request_id, fallback_prompt)
        return self.kv_cache_spec.compact_tokens(num_tokens, prompt)

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks,
                                   total_computed_tokens, num_local_computed_tokens,
                                   num_tokens_main_model, apply_admission_cap=False,
                                   prefill_end=0) -> int:  # fmt: skip
        # before the first allocation the prompt length is not recorded yet: vLLM's own
        # prefill boundary stands in (the prompt for a new request)
        return super().get_num_blocks_to_allocate(
            request_id,
            self._compact(request_id, num_tokens, prefill_end),
            new_computed_blocks,
            total_computed_tokens,
            num_local_computed_tokens,
            self._compact(request_id, num_tokens_main_model, prefill_end),
            apply_admission_cap=apply_admission_cap,
            prefill_end=prefill_end,
        )

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        return super().allocate_new_blocks(
            request_id,
            self._compact(request_id, num_tokens),
            self._compact(request_id, num_tokens_main_model),
        )

    def free(self, request_id: str) -> None:
        self.prompt_lens.pop(request_id, None)
        super().free(request_id)


def register() -> None:
    """Make vLLM's registry know the spec (after its built-ins, which it skips once anything
    is registered)."""
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(SpeedUpperSpec, SpeedUpperManager, SpeedUpperSpec)


register()


def use_compact_spec(attention, anchors: int, deep: int) -> None:
    """Give one upper attention layer the SPEED spec, built from the stock one it would have
    (the instance's own method shadows its class's)."""

    def get_kv_cache_spec(vllm_config) -> SpeedUpperSpec:
        stock = type(attention).get_kv_cache_spec(attention, vllm_config)
        kept = {f.name: getattr(stock, f.name) for f in fields(AttentionSpec) if f.init}
        return SpeedUpperSpec(**kept, speed_anchors=anchors, speed_deep=deep)

    attention.get_kv_cache_spec = get_kv_cache_spec
