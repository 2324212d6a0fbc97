"""The upper layers' metadata builder, fed what each of vLLM's GPU backends would be fed.

vLLM's CUDA backends build their metadata from the same `CommonAttentionMetadata` the CPU build
uses. FlashAttention's and Triton's builders construct and run on a CPU, so they run here for
real; FlashInfer's module needs the flashinfer package, so a stand-in reads exactly the fields
its builder reads (vllm/v1/attention/backends/flashinfer.py, 0.32). Every case checks the
metadata the stock builder receives, field by field, against the SPEED rule."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.worker.utils import AttentionGroup

from speedkv.errors import Unsupported
from speedkv.hf.loading import model_directory
from speedkv.vllm import batch
from speedkv.vllm.args import engine_args
from speedkv.vllm.attention import speed_backend
from speedkv.vllm.compact import compact_length
from speedkv.vllm.metadata import pinned_copies, to_device

ANCHORS, DEEP = 1, 2
LAYER = "model.layers.22.self_attn.attn"
BLOCK = 16


@pytest.fixture(scope="module")
def vllm_config():
    directory = model_directory("smollm2-135m", progress=False)
    args = engine_args(f"speed:lcut=22,anchors=bos,deep={DEEP}", directory)
    return EngineArgs(model=str(directory), dtype="float32", **args).create_engine_config()


@dataclasses.dataclass
class Step:
    """A mixed step: a decode, a first prefill chunk, a last prefill chunk, a short prompt
    whole, and a padding request with no rows."""

    prompt = torch.tensor([40, 50, 50, 3, 7])
    done = torch.tensor([44, 0, 30, 0, 0])
    chunk = torch.tensor([1, 30, 20, 3, 0])
    table = torch.tensor(
        [[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9], [10, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.int32
    )

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.done + self.chunk

    def positions(self) -> torch.Tensor:
        return torch.cat([torch.arange(d, d + c) for d, c in zip(self.done, self.chunk)])

    def common(self, block: int = BLOCK, **fields) -> CommonAttentionMetadata:
        query_start = torch.zeros(len(self.prompt) + 1, dtype=torch.int32)
        query_start[1:] = self.chunk.cumsum(0)
        positions = self.positions()
        request = torch.repeat_interleave(torch.arange(len(self.chunk)), self.chunk)
        # the runner's per-position slots (the lower layers'); the builder replaces them
        slots = self.table[request, positions // block].long() * block + positions % block
        values = dict(
            query_start_loc=query_start,
            query_start_loc_cpu=query_start.clone(),
            seq_lens=self.seq_lens.int(),
            num_reqs=len(self.prompt),
            num_actual_tokens=int(self.chunk.sum()),
            max_query_len=int(self.chunk.max()),
            max_seq_len=int(self.seq_lens.max()),
            block_table_tensor=self.table,
            slot_mapping=slots,
            causal=True,
            positions=positions,
            is_prefilling=self.done < self.prompt,
            seq_lens_cpu_upper_bound=self.seq_lens.int(),  # FlashInfer's seq_lens_cpu source
        )
        values.update(fields)
        return CommonAttentionMetadata(**values)

    def facts(self, blocks=None, block: int = BLOCK) -> batch.StepFacts:
        """What the V1 runner publishes: the host copy of the group's block table."""
        held = np.array(blocks if blocks is not None else [4, 4, 4, 4, 0])
        group = batch.GroupBlocks(frozenset([LAYER]), self.table.numpy(), held, block)
        return batch.StepFacts(self.prompt, (group,))

    def expected(self):
        """(rows, compact index, request of each row, compact length of each kept request)."""
        rows, compact, owner = [], [], []
        offset = 0
        for r, (d, c, p) in enumerate(zip(self.done, self.chunk, self.prompt)):
            start = max(int(p) - DEEP, 0)
            for pos in range(int(d), int(d + c)):
                if pos < ANCHORS or pos >= start:
                    rows.append(offset + pos - int(d))
                    compact.append(pos if pos < ANCHORS else pos - (start - ANCHORS))
                    owner.append(r)
            offset += int(c)
        kept = sorted(set(owner))
        lengths = compact_length(self.seq_lens, self.prompt, ANCHORS, DEEP)[kept]
        return rows, compact, owner, kept, lengths


class FlashInferLike(AttentionMetadataBuilder):
    """Reads what FlashInfer 0.32's builder reads of the common metadata."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        common = common_attn_metadata
        decodes, prefills, _, _ = split_decodes_and_prefills(common, decode_threshold=1)
        seq_lens_cpu = common.seq_lens_cpu_upper_bound  # what it reads without spec decode
        blocks = (seq_lens_cpu + self.kv_cache_spec.block_size - 1) // self.kv_cache_spec.block_size
        return dataclasses.make_dataclass("Meta", ["fields"])(
            {
                "num_reqs": common.num_reqs,
                "num_actual_tokens": common.num_actual_tokens,
                "qo_indptr_cpu": common.query_start_loc_cpu.clone(),
                "seq_lens": common.seq_lens.clone(),
                "seq_lens_cpu": seq_lens_cpu.clone(),
                "paged_kv_indptr": torch.cat([torch.zeros(1), blocks.cumsum(0)]).long(),
                "block_table": common.block_table_tensor.clone(),
                "slot_mapping": common.slot_mapping.clone(),
                "max_seq_len": common.max_seq_len,
                "split": (decodes, prefills),
            }
        )


def recording(base_builder: type) -> type:
    """`base_builder`, remembering the common metadata it was asked to build from."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False, **kwargs):
        self.received = common_attn_metadata
        return base_builder.build(self, common_prefix_len, common_attn_metadata, fast_build)

    return type("Recording" + base_builder.__name__, (base_builder,), {"build": build})


def backend_with(base_backend, builder_cls) -> type:
    return type(
        "Test" + builder_cls.__name__, (base_backend,),
        {"get_builder_cls": staticmethod(lambda: builder_cls)},
    )  # fmt: skip


BACKENDS = {
    "cpu_attn": (CPUAttentionBackend, CPUAttentionBackend.get_builder_cls()),
    "flash_attn": (FlashAttentionBackend, FlashAttentionBackend.get_builder_cls()),
    "triton_attn": (TritonAttentionBackend, TritonAttentionBackend.get_builder_cls()),
    "flashinfer": (CPUAttentionBackend, FlashInferLike),
}


def speed_builder(vllm_config, name: str, block_size: int = BLOCK):
    base_backend, base_builder = BACKENDS[name]
    backend = speed_backend(backend_with(base_backend, recording(base_builder)))
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=3, head_size=64,
                             dtype=torch.float32)  # fmt: skip
    with set_current_vllm_config(vllm_config):
        return backend.get_builder_cls()(spec, [LAYER], vllm_config, torch.device("cpu"))


def consistent(common: CommonAttentionMetadata) -> None:
    """Every per-request field has num_reqs entries, every per-row field num_actual_tokens,
    and the CPU copies agree with the tensors."""
    reqs, rows = common.num_reqs, common.num_actual_tokens
    assert common.query_start_loc_cpu.numel() == reqs + 1
    assert int(common.query_start_loc_cpu[-1]) == rows
    assert torch.equal(common.query_start_loc.cpu(), common.query_start_loc_cpu)
    for name in ("seq_lens", "seq_lens_cpu_upper_bound", "block_table_tensor", "is_prefilling"):
        value = getattr(common, name)
        assert value is None or value.shape[0] == reqs, name
    assert torch.equal(common.seq_lens_cpu_upper_bound, common.seq_lens.cpu())
    assert common.slot_mapping.numel() == rows and common.positions.numel() == rows
    query = common.query_start_loc_cpu[1:] - common.query_start_loc_cpu[:-1]
    assert common.max_query_len == int(query.max())
    assert common.max_seq_len == int(common.seq_lens.max())
    assert common._num_computed_tokens_cache is None
    assert common._token_to_req_indices_cache is None


@pytest.mark.parametrize("name", list(BACKENDS))
def test_each_backend_gets_the_full_depth_rows_only(vllm_config, name):
    step = Step()
    builder = speed_builder(vllm_config, name)
    with batch.publishing(step.facts()):
        metadata = builder.build(0, step.common())
    rows, compact, owner, kept, lengths = step.expected()
    assert metadata.speed_rows.tolist() == rows
    seen = builder.received
    consistent(seen)
    assert seen.num_reqs == len(kept) and seen.num_actual_tokens == len(rows)
    assert seen.seq_lens.tolist() == lengths.tolist()
    assert torch.equal(seen.block_table_tensor, step.table[kept])
    slots = [int(step.table[r, c // BLOCK]) * BLOCK + c % BLOCK for r, c in zip(owner, compact)]
    assert seen.slot_mapping.tolist() == slots
    assert seen.positions.tolist() == step.positions()[rows].tolist()
    assert seen.is_prefilling.tolist() == (step.done < step.prompt)[kept].tolist()
    if name == "flashinfer":
        assert metadata.fields["seq_lens_cpu"].tolist() == lengths.tolist()
    elif name != "cpu_attn":  # FlashAttention's and Triton's own metadata
        assert metadata.seq_lens.tolist() == lengths.tolist()
        assert metadata.slot_mapping.tolist() == slots


@pytest.mark.parametrize("name", list(BACKENDS))
def test_builders_refuse_graphs_and_block_table_reuse(vllm_config, name):
    """FlashAttention's builder would share one group's metadata with the next group of the
    same spec (a new block table and per-position slots), and capture decode steps in CUDA
    graphs; neither is right for SPEED's per-step compact rows."""
    builder = speed_builder(vllm_config, name)
    assert type(builder).supports_update_block_table is False
    spec = builder.kv_cache_spec
    assert type(builder).get_cudagraph_support(vllm_config, spec) == AttentionCGSupport.NEVER
    with pytest.raises(Unsupported, match="CUDA graph"):
        builder.build_for_cudagraph_capture(Step().common())
    with pytest.raises(Unsupported):
        builder.update_block_table(None, Step().table, torch.zeros(1))


def test_a_step_without_prompt_lengths_raises(vllm_config):
    """Metadata built outside the V1 runner's step (Model Runner V2, a drafter): the builder
    cannot tell prompt lengths and must not guess them."""
    with pytest.raises(Unsupported, match="cannot tell the prompt lengths"):
        speed_builder(vllm_config, "flash_attn").build(0, Step().common())


def test_a_dummy_step_is_built_as_stock(vllm_config):
    builder = speed_builder(vllm_config, "cpu_attn")
    common = Step().common()
    with batch.publishing("dummy"):
        metadata = builder.build(0, common)
    assert metadata.speed_rows is None and builder.received is common


def test_rows_beyond_the_allocated_blocks_raise(vllm_config):
    """The last prefill chunk's request holds no upper block: its compact rows have nowhere
    to go, and writing them would corrupt another request's K/V."""
    step = Step()
    with (
        batch.publishing(step.facts(blocks=[4, 4, 0, 4, 0])),
        pytest.raises(Unsupported, match="request 2 beyond the blocks"),
    ):
        speed_builder(vllm_config, "triton_attn").build(0, step.common())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("dcp_local_seq_lens", torch.ones(5, dtype=torch.int32), "decode context parallelism"),
        ("logits_indices_padded", torch.zeros(5, dtype=torch.int64), "KV-sharing fast prefill"),
        ("rswa_prefix_lens", torch.ones(5, dtype=torch.int32), "sliding-window"),
        ("encoder_seq_lens", torch.ones(5, dtype=torch.int32), "cross-attention"),
    ],
)
def test_fields_of_unsupported_features_are_refused(vllm_config, field, value, message):
    step = Step()
    with batch.publishing(step.facts()), pytest.raises(Unsupported, match=message):
        speed_builder(vllm_config, "flash_attn").build(0, step.common(**{field: value}))


def test_a_per_request_causal_tensor_keeps_the_kept_requests(vllm_config):
    step = Step()
    causal = torch.tensor([1, 0, 1, 1, 1], dtype=torch.int32)  # as FlashAttention takes it
    builder = speed_builder(vllm_config, "flash_attn")
    with batch.publishing(step.facts()):
        builder.build(0, step.common(causal=causal))
    *_, kept, _ = step.expected()
    assert builder.received.causal.tolist() == causal[kept].tolist()


def test_an_unknown_metadata_field_raises_naming_it(vllm_config):
    """A newer vLLM adds a field: the plugin stops at once instead of passing it on as is."""

    @dataclasses.dataclass
    class NewerCommonMetadata(CommonAttentionMetadata):
        sparse_window: torch.Tensor | None = None

    step = Step()
    known = step.common()
    fields = dataclasses.fields(CommonAttentionMetadata)
    common = NewerCommonMetadata(**{f.name: getattr(known, f.name) for f in fields})
    with batch.publishing(step.facts()), pytest.raises(Unsupported, match="sparse_window"):
        speed_builder(vllm_config, "flash_attn").build(0, common)


@pytest.mark.parametrize("kernel_block", [16, 32, 64])
def test_kernel_blocks_smaller_than_the_managers_name_the_same_slots(vllm_config, kernel_block):
    """vLLM hands the builder a block table in the attention kernel's smaller blocks (manager
    block b -> kernel blocks b * m + j). The compact slots must be the ones the manager's
    blocks give: the same K/V addresses whichever unit the builder works in."""
    manager = 128
    spec = FullAttentionSpec(block_size=manager, num_kv_heads=3, head_size=64,
                             dtype=torch.float32)  # fmt: skip
    base_backend, base_builder = BACKENDS["flash_attn"]
    backend = speed_backend(backend_with(base_backend, recording(base_builder)))
    group = AttentionGroup(backend, [LAYER], spec, 0)
    with set_current_vllm_config(vllm_config):
        group.create_metadata_builders(vllm_config, torch.device("cpu"), kernel_block)
    step = Step()
    step.prompt = torch.tensor([40, 500, 500, 3, 7])  # the decode's compact row 262: block 2
    step.done = torch.tensor([299, 0, 300, 0, 0])
    step.chunk = torch.tensor([1, 30, 200, 3, 0])
    with batch.publishing(step.facts(block=manager)):
        group.build_metadata(step.common(block=manager))
    seen = group.get_metadata_builder().received
    _, compact, owner, kept, _ = step.expected()
    want = [int(step.table[r, c // manager]) * manager + c % manager
            for r, c in zip(owner, compact)]  # fmt: skip
    assert seen.slot_mapping.tolist() == want
    # the kernel's own table, restricted to the requests kept
    kernel_table = group.map_to_kernel_block_table(step.table)[kept]
    assert torch.equal(seen.block_table_tensor, kernel_table)
    per_block = manager // kernel_block
    for r, c, slot in zip(owner, compact, want):  # the same slot, addressed in kernel blocks
        row = kernel_table[kept.index(r)]
        assert int(row[c // kernel_block]) * kernel_block + c % kernel_block == slot
        assert int(row[0]) == int(step.table[r, 0]) * per_block


def test_host_tensors_reach_the_device_as_they_were():
    """The builder's per-step host tensors reach the step's device unchanged: on a CPU by the
    plain copy it always made (no pinned memory), on a CUDA GPU from a fresh pinned buffer,
    asynchronously. There, many copies in flight while their host buffers are freed and the
    host allocates again must each arrive intact."""
    host = torch.arange(1000, dtype=torch.long) * 7
    same = to_device(host, "cpu", torch.int32)
    assert same.dtype == torch.int32 and torch.equal(same, host.int()) and not same.is_pinned()
    if not torch.cuda.is_available():
        return
    assert pinned_copies()
    sent = [torch.randint(0, 1 << 30, (4096,)) for _ in range(64)]
    arrived = [to_device(t, "cuda", torch.int32) for t in sent]
    for i in range(64):  # host memory churns while the copies may still run
        torch.empty(4096, dtype=torch.int32, pin_memory=True).fill_(-i)
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), t.int()) for a, t in zip(arrived, sent))
