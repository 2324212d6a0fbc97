"""The upper layers' attention backend: the model's own backend, fed SPEED's compact layout.

Two overrides of whatever backend vLLM picked for the model (CPU_ATTN here):
- the metadata builder keeps only the step's full-depth rows, gives each request its compact
  length and computes the compact cache slots (`compact.py`), then lets the stock builder do
  the rest; the rows travel with the metadata so the model can gather them,
- the layer's K/V write goes to those compact slots instead of the runner's per-position ones.

Giving the upper layers a backend class of their own is what makes the runner build them their
own metadata (it groups layers by backend class).
"""

from __future__ import annotations

import functools
import types

import torch
from vllm.forward_context import get_forward_context, is_forward_context_available

from speedkv.vllm import batch
from speedkv.vllm.compact import compact_slots, full_depth_rows
from speedkv.vllm.settings import SpeedSettings


class SpeedBuilderMixin:
    """Builds the upper layers' metadata over the full-depth rows only."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        common = common_attn_metadata
        rule = SpeedSettings.from_hf_config(self.vllm_config.model_config.hf_config)
        found = full_depth_rows(
            positions=common.positions.cpu(),
            query_start=common.query_start_loc_cpu,
            seq_lens=common.seq_lens.cpu(),
            prompt_lens=batch.prompt_lengths(common.num_reqs),
            anchors=rule.anchors,
            deep=rule.deep,
        )
        device = common.query_start_loc.device
        rows = found.rows.to(device)
        if found.count == 0:
            # e.g. a step of middle prompt chunks only: the model skips the upper layers, so
            # this metadata (the stock one) is never read
            metadata = super().build(common_prefix_len, common, fast_build)
            metadata.speed_rows = rows
            return metadata
        block_size = self.kv_cache_spec.block_size
        query_start = found.query_start.to(device)
        seq_lens = found.seq_lens.to(device)
        compact = common.replace(
            query_start_loc=query_start,
            query_start_loc_cpu=found.query_start,
            seq_lens=seq_lens,
            seq_lens_cpu_upper_bound=found.seq_lens,
            num_reqs=int(found.requests.numel()),
            num_actual_tokens=found.count,
            max_query_len=int((found.query_start[1:] - found.query_start[:-1]).max()),
            max_seq_len=int(found.seq_lens.max()),
            block_table_tensor=common.block_table_tensor[found.requests.to(device)],
            slot_mapping=compact_slots(common.block_table_tensor.cpu(), found, block_size).to(
                device
            ),
            positions=common.positions[rows],
            is_prefilling=None,
            req_idx=None,
            rswa_prefix_lens=None,
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )
        metadata = super().build(0, compact, fast_build)
        metadata.speed_rows = rows
        return metadata


def write_compact_kv(impl, layer, key, value, kv_cache, slot_mapping) -> None:
    """The upper layers' K/V write: at the compact slots the builder computed, where the
    runner's slot mapping has one slot per position."""
    metadata = layer_metadata(layer.layer_name)
    if metadata is not None:
        slot_mapping = metadata.slot_mapping
    type(impl).do_kv_cache_update(impl, layer, key, value, kv_cache, slot_mapping)


def layer_metadata(layer_name: str):
    """This step's attention metadata of one layer, or None outside a step with metadata
    (warm-up and profiling runs)."""
    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):
        raise NotImplementedError("SPEED in vLLM does not run micro-batched or speculative steps")
    if isinstance(metadata, dict):
        return metadata.get(layer_name)
    return metadata


@functools.cache
def speed_backend(base):
    """The SPEED variant of an attention backend class: its builder keeps the full-depth rows.
    One per base, so every upper layer shares it and the runner groups them together."""
    builder = type(
        "Speed" + base.get_builder_cls().__name__, (SpeedBuilderMixin, base.get_builder_cls()), {}
    )
    return type(
        "Speed" + base.__name__, (base,), {"get_builder_cls": staticmethod(lambda: builder)}
    )


def use_speed_backend(attention) -> None:
    """Turn one of the model's attention layers into an upper (SPEED) layer."""
    attention.attn_backend = speed_backend(attention.attn_backend)
    # the instance's own method shadows its class's: the write goes to the compact slots
    attention.impl.do_kv_cache_update = types.MethodType(write_compact_kv, attention.impl)


def rows_of_step(attention) -> torch.Tensor | None:
    """The step's full-depth rows, as the upper layers' builder found them; None in warm-up
    and profiling runs, which carry no metadata."""
    metadata = layer_metadata(attention.layer_name)
    return None if metadata is None else metadata.speed_rows
