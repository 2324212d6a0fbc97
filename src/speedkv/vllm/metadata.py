"""The upper layers' attention metadata, built field by field from the step's common metadata.

vLLM describes a step to every attention backend with one `CommonAttentionMetadata`: its rows
(tokens) and its requests. The upper layers see only the step's full-depth rows (`compact.py`),
so each field of that dataclass has one explicit rule here:

- `compact`: recomputed for the full-depth rows (row offsets, compact lengths, compact slots),
- `requests`: the entries of the requests that keep at least one row,
- `rows`: the entries of the rows kept,
- `reset`: a cache vLLM derives on demand from the fields above; dropped so it is rebuilt,
- `refused`: a feature SPEED does not support; the field must be unset.

A field this table does not know (a newer vLLM) raises, naming it, before any step runs: the
plugin never hands a backend a field it has not decided about.

Pure Python and torch, so the rules are tested without vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import torch

from speedkv.errors import Unsupported
from speedkv.vllm.compact import FullDepthRows

COMPACT, REQUESTS, ROWS, RESET, REFUSED = "compact", "requests", "rows", "reset", "refused"

RULES: dict[str, str] = {
    "query_start_loc": COMPACT,
    "query_start_loc_cpu": COMPACT,
    "seq_lens": COMPACT,
    "seq_lens_cpu_upper_bound": COMPACT,
    "num_reqs": COMPACT,
    "num_actual_tokens": COMPACT,
    "max_query_len": COMPACT,
    "max_seq_len": COMPACT,
    "slot_mapping": COMPACT,
    "block_table_tensor": REQUESTS,
    "causal": REQUESTS,  # True stays True; a per-request tensor keeps the kept requests' rows
    "is_prefilling": REQUESTS,
    "req_idx": REQUESTS,
    "positions": ROWS,
    "_num_computed_tokens_cache": RESET,
    "_token_to_req_indices_cache": RESET,
    "logits_indices_padded": REFUSED,
    "num_logits_indices": REFUSED,
    "max_logits_per_req": REFUSED,
    "encoder_seq_lens": REFUSED,
    "encoder_seq_lens_cpu": REFUSED,
    "dcp_local_seq_lens": REFUSED,
    "dcp_local_seq_lens_cpu_upper_bound": REFUSED,
    "mm_req_doc_ranges": REFUSED,
    "rswa_prefix_lens": REFUSED,
    "replayssm_decode_base_cpu": REFUSED,
}

# what a refused field serves, for the error
REFUSED_FEATURES = {
    "logits_indices_padded": "KV-sharing fast prefill",
    "num_logits_indices": "KV-sharing fast prefill",
    "max_logits_per_req": "KV-sharing fast prefill",
    "encoder_seq_lens": "cross-attention",
    "encoder_seq_lens_cpu": "cross-attention",
    "dcp_local_seq_lens": "decode context parallelism",
    "dcp_local_seq_lens_cpu_upper_bound": "decode context parallelism",
    "mm_req_doc_ranges": "multimodal bidirectional ranges",
    "rswa_prefix_lens": "reference sliding-window attention",
    "replayssm_decode_base_cpu": "Mamba state replay",
}


def check_fields(metadata_type: type) -> None:
    """Raise unless every field of vLLM's common metadata has a rule here."""
    unknown = [f.name for f in dataclasses.fields(metadata_type) if f.name not in RULES]
    if unknown:
        raise Unsupported(
            f"vLLM's {metadata_type.__name__} has field(s) {', '.join(unknown)} that the SPEED "
            "plugin has no rule for; this vLLM is newer than the plugin (speedkv runs vLLM 0.32)"
        )


def compact_metadata(
    common: Any, rows: FullDepthRows, slots: torch.Tensor, kernel_blocks_per_block: int = 1
) -> Any:
    """`common` restricted to the full-depth rows `rows`, whose K/V go to `slots`. Where
    `rows` are segments (`compact.segmented`), each reads its request's block table from its
    `block_offset` on (in the KV manager's blocks, `kernel_blocks_per_block` kernel blocks
    each)."""
    check_fields(type(common))
    device = common.query_start_loc.device
    query_lens = rows.query_start[1:] - rows.query_start[:-1]
    compact = {
        "query_start_loc": to_device(rows.query_start, device, common.query_start_loc.dtype),
        "query_start_loc_cpu": rows.query_start.to(common.query_start_loc_cpu.dtype),
        "seq_lens": to_device(rows.seq_lens, device, common.seq_lens.dtype),
        "seq_lens_cpu_upper_bound": rows.seq_lens.clone(),
        "num_reqs": int(rows.requests.numel()),
        "num_actual_tokens": rows.count,
        "max_query_len": int(query_lens.max()),
        "max_seq_len": int(rows.seq_lens.max()),
        "slot_mapping": to_device(slots, device, common.slot_mapping.dtype),
    }
    values = {}
    for field in dataclasses.fields(common):
        name, rule = field.name, RULES[field.name]
        value = getattr(common, name)
        if rule == COMPACT:
            values[name] = compact[name]
        elif rule == REQUESTS:
            values[name] = _take(value, rows.requests)
        elif rule == ROWS:
            values[name] = _take(value, rows.rows)
        elif rule == RESET:
            values[name] = None
        elif value is not None:  # REFUSED
            raise Unsupported(
                f"SPEED in vLLM does not support {REFUSED_FEATURES[name]} "
                f"(the step's attention metadata sets {name})"
            )
    if rows.block_offset is not None and bool(rows.block_offset.any()):
        table = values["block_table_tensor"]
        offset = to_device(rows.block_offset * kernel_blocks_per_block, table.device, torch.long)
        columns = torch.arange(table.shape[1], device=table.device)[None, :] + offset[:, None]
        # the columns past the end are never read: a segment's length stops short of them
        values["block_table_tensor"] = table.gather(1, columns.clamp(max=table.shape[1] - 1))
    return dataclasses.replace(common, **values)


def _take(value: Any, index: torch.Tensor) -> Any:
    """The entries `index` of a per-request or per-row field, on the field's own device."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, np.ndarray):
        return value[index.numpy()]
    return value[to_device(index, value.device)]


def to_device(host: torch.Tensor, device: torch.device | str,
              dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """A tensor the builder computed on the host this step, on `device` (in `dtype`).

    On a CUDA device the copy is asynchronous, from page-locked memory, so the step's host work
    goes on while it runs; anywhere else it is the plain `.to(device, dtype)` it always was.
    Correct by construction:
    - the pinned buffer is new for each call and filled before the copy is queued; nothing
      writes to it afterwards (the caller keeps only the device tensor);
    - when it is freed, torch's caching host allocator hands its memory out again only after
      the copy has completed (a non-blocking copy from pinned memory records an event on the
      stream that runs it);
    - the copy runs on the current stream, where the attention kernels that read the result
      run after it, the order vLLM's own non-blocking input copies rely on.
    """
    device = torch.device(device)
    if device.type != "cuda" or host.device.type != "cpu" or not pinned_copies():
        return host.to(device, dtype)
    pinned = torch.empty(host.shape, dtype=dtype or host.dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(device, non_blocking=True)


@functools.cache
def pinned_copies() -> bool:
    """Whether host memory can be page-locked here: CUDA is there, and vLLM (where installed)
    does not rule it out (it does under WSL, for one)."""
    if not torch.cuda.is_available():
        return False
    try:
        from vllm.utils.platform_utils import is_pin_memory_available
    except ImportError:
        return True
    return bool(is_pin_memory_available())
