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

With prefix caching the manager also records each request's rows at every block boundary it
has computed and registers its blocks under keys of their own (`prefix_index.py`), finds the
longest cached prefix for a new request, and counts a hit in rows, not tokens, so that vLLM's
copy-on-write gives the request a private copy of a part-filled last block.

Importing this module registers the spec with vLLM. The spec travels from the worker to the
engine core by pickling, so both processes import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import ClassVar

from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_utils import KVCacheBlock, make_block_hash_with_group_id
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from speedkv.vllm.compact import RequestLayout, anchor_slots
from speedkv.vllm.prefix_index import FRESH, Record, block_key, index_of, state_after


@dataclass(frozen=True, kw_only=True)
class SpeedUpperSpec(AttentionSpec):
    """An upper layer's KV: the full-depth rows of each request, in compact order."""

    speed_anchors: int
    speed_deep: int
    # the model's widest sliding window (SpeedRule.deep_for), None without one; and whether
    # this group's layers apply it (their anchors then fill blocks of their own: compact.py)
    speed_window: int | None = None
    speed_segmented: bool = False

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
    """Allocates an upper group's blocks by compact length instead of token count, and caches
    them for prefix reuse (`prefix_index.py`)."""

    # hits land on the scheduler's block boundaries only, as the lower groups' do
    supports_fine_grained_hash_lookup: ClassVar[bool] = False

    def __init__(self, kv_cache_spec: SpeedUpperSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.prompt_lens: dict[str, int] = {}
        # per running request: (tokens reused from the prefix cache, compact rows they hold)
        self.hits: dict[str, tuple[int, int]] = {}
        self.states: dict[str, bytes] = {}  # the state each request started from
        self.full_keys: dict[str, list[bytes]] = {}  # the keys of its full blocks so far
        self.recorded: dict[str, int] = {}  # the last boundary it recorded
        self.requests: dict[str, object] = {}  # vLLM's request objects, for their hashes

    def remove_skipped_blocks(self, request_id, processed_computed_tokens,
                              num_prompt_tokens=None) -> None:  # fmt: skip
        if num_prompt_tokens is not None:
            self.prompt_lens[request_id] = num_prompt_tokens
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def _layout(self, request_id: str, fallback_prompt: int = 0,
                hit: tuple[int, int] | None = None) -> RequestLayout:  # fmt: skip
        prompt = self.prompt_lens.get(request_id, fallback_prompt)
        tokens, rows = hit if hit is not None else self.hits.get(request_id, (0, 0))
        spec = self.kv_cache_spec
        return RequestLayout.of(prompt, spec.speed_anchors, spec.speed_deep, tokens, rows,
                                spec.speed_window)  # fmt: skip

    @property
    def _anchor_slots(self) -> int:
        spec = self.kv_cache_spec
        return anchor_slots(spec.speed_anchors, self.block_size) if spec.speed_segmented else 0

    def _new_hit(
        self, request_id: str, num_local_computed_tokens: int, blocks: Sequence[KVCacheBlock]
    ) -> tuple[tuple[int, int], Record | None]:
        """(tokens, rows) of a request's prefix hit, and the record it came from."""
        if request_id in self.hits or num_local_computed_tokens == 0:  # running, or no hit
            return self.hits.get(request_id, (0, 0)), None
        record = index_of(self.block_pool).hit(num_local_computed_tokens, blocks)
        return (num_local_computed_tokens, record.rows), record

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks,
                                   total_computed_tokens, num_local_computed_tokens,
                                   num_tokens_main_model, apply_admission_cap=False,
                                   prefill_end=0) -> int:  # fmt: skip
        # before the first allocation the prompt length is not recorded yet: vLLM's own
        # prefill boundary stands in (the prompt for a new request)
        hit, _ = self._new_hit(request_id, num_local_computed_tokens, new_computed_blocks)
        layout = self._layout(request_id, prefill_end, hit)
        return super().get_num_blocks_to_allocate(
            request_id,
            layout.rows(num_tokens, self._anchor_slots),
            new_computed_blocks,
            hit[1],
            hit[1],
            layout.rows(num_tokens_main_model, self._anchor_slots),
            apply_admission_cap=apply_admission_cap,
            prefill_end=prefill_end,
        )

    def add_local_computed_blocks(self, request_id, new_computed_blocks,
                                  num_local_computed_tokens,
                                  num_external_computed_tokens) -> None:  # fmt: skip
        hit, record = self._new_hit(request_id, num_local_computed_tokens, new_computed_blocks)
        if record is not None:
            self.hits[request_id] = hit
            self.states[request_id] = record.state
            self.full_keys[request_id] = list(record.keys[: hit[1] // self.block_size])
            self.recorded[request_id] = hit[0]
        # the base class counts in this group's unit: rows, not tokens (a part-filled last
        # block becomes the request's own copy)
        super().add_local_computed_blocks(
            request_id, new_computed_blocks, hit[1], num_external_computed_tokens
        )

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        self.hits.setdefault(request_id, (0, 0))  # from now on the request is running
        layout = self._layout(request_id)
        return super().allocate_new_blocks(
            request_id,
            layout.rows(num_tokens, self._anchor_slots),
            layout.rows(num_tokens_main_model, self._anchor_slots),
        )

    def cache_blocks(self, request, num_tokens, retention_interval=None, *,
                     replay_boundaries=()) -> None:  # fmt: skip
        """Record the request's compact rows at each scheduler block boundary it has computed,
        and register its blocks under their keys. Only tokens of earlier steps: a hit on rows
        this step writes would copy them before they exist. What the last step computed is
        recorded when the request is freed."""
        if self.enable_caching:
            self.requests[request.request_id] = request
            self._record(request, min(num_tokens, request.num_computed_tokens))

    def _record(self, request, done: int) -> None:
        request_id = request.request_id
        step = self.cache_hit_alignment_tokens
        first = self.recorded.get(request_id, 0) // step * step + step
        if first > done:
            return
        layout = self._layout(request_id, request.num_prompt_tokens)
        deep_from = layout.deep_from
        base = self.states.get(request_id, FRESH)
        keys = self.full_keys.setdefault(request_id, [])
        blocks = self.req_to_blocks[request_id]
        index = index_of(self.block_pool)
        hash_size = self.block_pool.hash_block_size
        for boundary in range(first, done + 1, step):
            token_hash = request.block_hashes[boundary // hash_size - 1]
            state = state_after(base, token_hash, deep_from, boundary)
            rows = layout.rows(boundary)
            while len(keys) < rows // self.block_size:  # blocks filled since the last one
                keys.append(self._register(state, len(keys), blocks, boundary))
            record_keys = keys[: rows // self.block_size]
            if rows % self.block_size:
                record_keys = [*record_keys, self._register(state, len(keys), blocks, boundary,
                                                            rows)]  # fmt: skip
            index.add(token_hash, Record(state, rows, tuple(record_keys)))
        self.recorded[request_id] = done
        self.num_cached_block[request_id] = len(keys)  # vLLM reads it as "running"

    def _register(self, state: bytes, index: int, blocks: list[KVCacheBlock], boundary: int,
                  rows: int | None = None) -> bytes:  # fmt: skip
        """Put block `index` of a request in the pool's cache under its key."""
        rows = (index + 1) * self.block_size if rows is None else rows
        key = block_key(state, index, rows, self.block_size)
        self.block_pool._insert_block_hash(
            make_block_hash_with_group_id(key, self.kv_cache_group_id), blocks[index],
            num_tokens=boundary,
        )  # fmt: skip
        return key

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool,
                               kv_cache_spec, drop_eagle_block, alignment_tokens,
                               dcp_world_size=1, pcp_world_size=1):  # fmt: skip
        """The longest boundary up to `max_length` whose compact rows are all still cached.

        A windowed (segmented) group reuses only a prefix whose upper rows are its anchors
        alone, at a boundary no earlier than the window rule's bound (`window + anchors - 1`).
        Such a hit leaves the request the layout of a fresh prefill: the anchors' block, then
        one run of consecutive deep rows, which see no anchor (`compact.segmented`). A prefix
        that holds earlier deep rows keeps them in the blocks before the deep segment, which a
        deep row never reads; by position they may be inside its window (a prompt that
        continues an earlier one by a few tokens). The lookup passes over such a record for
        the longest prefix without one."""
        narrowed = {}
        if kv_cache_spec.speed_segmented:
            anchors = kv_cache_spec.speed_anchors
            bound = kv_cache_spec.speed_window + anchors - 1 if anchors else 0
            narrowed = {"max_rows": anchors, "min_boundary": bound}
        return index_of(block_pool).longest_hit(
            block_hashes, max_length, kv_cache_group_ids, block_pool, alignment_tokens, **narrowed
        )

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        # a finished or preempted request: its last step has run (steps run in order, so any
        # request that hits these rows runs after it)
        request = self.requests.pop(request_id, None)
        if request is not None and request_id in self.req_to_blocks:
            self._record(request, request.num_computed_tokens)
        for kept in (self.prompt_lens, self.hits, self.states, self.full_keys, self.recorded):
            kept.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)


def register() -> None:
    """Make vLLM's registry know the spec (after its built-ins, which it skips once anything
    is registered)."""
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(SpeedUpperSpec, SpeedUpperManager, SpeedUpperSpec)


register()


def use_compact_spec(attention, anchors: int, deep: int, window: int | None = None) -> None:
    """Give one upper attention layer the SPEED spec, built from the stock one it would have
    (the instance's own method shadows its class's). `window`: the model's widest sliding
    window. A windowed layer's stock spec would be vLLM's sliding-window one, whose manager
    frees blocks by position; this one frees none, and the kernel keeps applying the window."""

    def get_kv_cache_spec(vllm_config) -> SpeedUpperSpec:
        stock = type(attention).get_kv_cache_spec(attention, vllm_config)
        kept = {f.name: getattr(stock, f.name) for f in fields(AttentionSpec) if f.init}
        return SpeedUpperSpec(
            **kept,
            speed_anchors=anchors,
            speed_deep=deep,
            speed_window=window,
            speed_segmented=attention.sliding_window is not None,
        )

    attention.get_kv_cache_spec = get_kv_cache_spec
