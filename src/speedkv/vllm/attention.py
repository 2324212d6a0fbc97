"""The upper layers' attention backend: the model's own backend, fed SPEED's compact layout.

Two overrides of whatever backend vLLM picked for the model (CPU_ATTN here; FlashAttention,
FlashInfer or Triton on a GPU):
- the metadata builder keeps only the step's full-depth rows, gives each request its compact
  length and computes the compact cache slots (`compact.py`), restricts every other field of
  the step's metadata by an explicit rule (`metadata.py`), then lets the stock builder do the
  rest; the rows travel with the metadata so the model can gather them,
- the layer's K/V write goes to those compact slots instead of the runner's per-position ones.

The builder refuses what it cannot do right: CUDA graph capture (its tensors are new each step),
reusing another group's metadata with a new block table (`supports_update_block_table`), a step
whose prompt lengths it cannot tell (`batch.py`), and compact rows the KV manager holds no
blocks for.

Giving the upper layers a backend class of their own is what makes the runner build them their
own metadata (it groups layers by backend class).
"""

from __future__ import annotations

import functools
import types
from typing import ClassVar

import torch
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata

from speedkv.errors import Unsupported
from speedkv.vllm import batch
from speedkv.vllm.compact import (
    compact_slots,
    full_depth_rows,
    requests_short_of_blocks,
    segmented,
    step_positions,
)
from speedkv.vllm.metadata import check_fields, compact_metadata, to_device
from speedkv.vllm.settings import SpeedSettings

NO_GRAPHS = (
    "SPEED in vLLM cannot be captured in a CUDA graph: which rows enter the upper layers "
    "changes every step"
)


class SpeedBuilderMixin:
    """Builds the upper layers' metadata over the full-depth rows only."""

    # graphs would replay the tensors of the capture step; the runner then captures none
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    # each upper group gets its own compact build, never another group's with a new table
    supports_update_block_table: ClassVar[bool] = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        check_fields(CommonAttentionMetadata)  # a newer vLLM fails at engine start
        self.speed = SpeedSettings.from_hf_config(self.vllm_config.model_config.hf_config)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return AttentionCGSupport.NEVER

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False, **kwargs):
        common = common_attn_metadata
        step = batch.current_step()
        if step is None:  # a dummy step: shapes only, every row goes up, as in stock vLLM
            metadata = super().build(common_prefix_len, common, fast_build, **kwargs)
            metadata.speed_rows = metadata.speed_rows_cpu = None
            return metadata
        query_start = common.query_start_loc_cpu
        seq_lens = common.seq_lens_cpu_upper_bound
        if seq_lens is None:
            seq_lens = common.seq_lens.cpu()
        prompt_lens = step.prompt_lens[: common.num_reqs]
        positions = step_positions(query_start, seq_lens)
        if common.positions is not None and common.positions.device.type == "cpu":
            # the layout step_positions assumes, checked where it costs no host sync
            actual = common.positions[: positions.numel()]
            if not torch.equal(actual.long(), positions):
                raise Unsupported(
                    "SPEED found a step whose rows are not each request's next positions in "
                    "order (speculative decoding or M-RoPE); it cannot place them"
                )
        # a compact group's spec carries the model's window and whether its layers have it
        spec = self.kv_cache_spec
        window = getattr(spec, "speed_window", None)
        layout = step.layout(common.num_reqs, self.speed.anchors, self.speed.deep, window)
        found = full_depth_rows(positions, query_start, seq_lens, layout)
        real = (query_start[1:] - query_start[:-1]) > 0
        if bool((prompt_lens[real] <= 0).any()):
            raise Unsupported(batch.NO_STEP)
        if found.count == 0:
            # e.g. a step of middle prompt chunks only: the model skips the upper layers, so
            # this metadata (the stock one) is never read
            metadata = super().build(common_prefix_len, common, fast_build, **kwargs)
            metadata.speed_rows = metadata.speed_rows_cpu = found.rows
            return metadata
        # the KV manager's blocks, on the host: slots are in its unit, and reading the
        # device's table back would cost a sync on a GPU
        held = step.blocks_of(self.layer_names[0])
        if getattr(spec, "speed_segmented", False):
            found = segmented(found, layout, seq_lens[: common.num_reqs], held.block_size)
        blocks = torch.from_numpy(held.blocks_per_row[: common.num_reqs])
        short = requests_short_of_blocks(found, blocks, held.block_size)
        if short.numel():
            raise Unsupported(
                f"SPEED's upper layers would write K/V of request {int(short[0])} beyond the "
                "blocks vLLM's KV manager holds for it; refusing to corrupt the cache"
            )
        table = torch.from_numpy(held.table[: common.num_reqs])
        slots = compact_slots(table, found, held.block_size)
        if held.block_size % spec.block_size:
            raise Unsupported(
                f"SPEED cannot map KV manager blocks of {held.block_size} tokens onto kernel "
                f"blocks of {spec.block_size}"
            )
        compact = compact_metadata(common, found, slots, held.block_size // spec.block_size)
        metadata = super().build(0, compact, fast_build, **kwargs)
        # pinned and non-blocking on a GPU: the host tensor is the builder's own (metadata.py)
        metadata.speed_rows = to_device(found.rows, common.query_start_loc.device)
        metadata.speed_rows_cpu = found.rows
        return metadata

    def build_for_cudagraph_capture(self, common_attn_metadata):
        raise Unsupported(NO_GRAPHS)

    def update_block_table(self, metadata, blk_table, slot_mapping):
        raise Unsupported(
            "SPEED builds each upper KV cache group's metadata itself; vLLM asked to reuse "
            "another group's with a new block table"
        )

    def build_for_drafting(self, common_attn_metadata, draft_index):
        raise Unsupported("SPEED in vLLM does not run speculative decoding")


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
        raise Unsupported("SPEED in vLLM does not run micro-batched or speculative steps")
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


def rows_of_step(layer_names: list[str]) -> torch.Tensor | None:
    """The step's full-depth rows, as the upper layers' builders found them; None in warm-up
    and profiling runs, which carry no metadata or a dummy's. Every upper KV cache group
    builds its own metadata: they must agree, or the step stops."""
    found = None
    seen: set[int] = set()
    for name in layer_names:
        metadata = layer_metadata(name)
        if metadata is None or id(metadata) in seen:
            continue
        seen.add(id(metadata))
        if not hasattr(metadata, "speed_rows"):
            raise Unsupported(
                f"layer {name} got attention metadata the SPEED builder did not build"
            )
        if found is None:
            found = metadata
        elif not _same_rows(found.speed_rows_cpu, metadata.speed_rows_cpu):
            raise Unsupported(
                f"SPEED's upper KV cache groups disagree on the step's full-depth rows ({name})"
            )
    return None if found is None else found.speed_rows


def _same_rows(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)
