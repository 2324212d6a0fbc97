"""The engine against two independent computations: transformers' own `generate`, and SPEED
in dense form through transformers' own layers (speedkv.dense)."""

import itertools

import pytest
import torch

from speedkv.analysis.dense import speed_dense_forward
from speedkv.core.engine import Request
from speedkv.core.prefill import Chunks
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams

from conftest import EQUIVALENCE_PARAMS, random_prompt
from helpers import greedy_with_logits, hf_generate

TINY_PARAMS = EQUIVALENCE_PARAMS  # the shared tiny models, Gemma 3 included


@pytest.mark.parametrize("n", [1, 37, 70])
def test_full_and_uncut_speed_equal_hf_generate(tiny, tiny_engine, n):
    ids = random_prompt(n)
    expected = hf_generate(tiny.hf_model, ids, 12, min_new_tokens=12)
    L = tiny.shape.num_layers
    for spec in (
        "full",
        f"speed:lcut={L},anchors=bos,deep=1",
        f"speed:lcut={L},anchors=none,deep=5",
    ):
        request = Request(ids, make_policy(spec, tiny.shape), SamplingParams(max_new_tokens=12))
        assert tiny_engine.generate([request])[0].output_ids == expected, spec


@pytest.mark.parametrize("n", [20, 64, 90])
def test_the_default_deep_suffix_runs_short_prompts_at_full_depth(tiny, tiny_engine, n):
    """`speed` with its default deep suffix (64 tokens): a prompt of at most 64 tokens runs
    every layer, so it answers as full attention does; a longer one is cut below its last 64
    tokens and equals the dense reference at deep=64."""
    from speedkv.methods.speed import DEFAULT_DEEP

    ids = random_prompt(n, seed=n)
    lcut = 2
    policy = make_policy(f"speed:lcut={lcut},anchors=bos", tiny.shape)
    assert policy.rule.deep == DEFAULT_DEEP == 64
    tokens, logits, _ = greedy_with_logits(tiny_engine, ids, policy, steps=6)
    full, _, _ = greedy_with_logits(tiny_engine, ids, make_policy("full", tiny.shape), steps=6)
    dense, positions = speed_dense_forward(
        tiny.backbone, torch.tensor(ids + tokens[:-1]), n, lcut, 1, DEFAULT_DEEP, False
    )
    dense = dense[positions >= n - 1]
    assert torch.allclose(logits, dense, atol=1e-4, rtol=0)
    if n <= DEFAULT_DEEP:
        assert tokens == full
    else:  # the cut shows: each upper layer holds the anchor and the 64 deep rows, not n
        lengths = tiny_engine.prefill(ids, f"speed:lcut={lcut},anchors=bos").cache.lengths()
        assert lengths == [n] * lcut + [1 + DEFAULT_DEEP] * (tiny.shape.num_layers - lcut)


GRID = list(
    itertools.product(
        [0, 1, 3, 5],  # lcut, including 0 and L-1 for the 6-layer tiny models
        [("none", 0), ("bos", 1), ("sink:4", 4)],
        [1, 4],  # deep suffix
        [False, True],  # SelfOnly
    )
)


@pytest.mark.parametrize("lcut, anchors, deep, selfonly", GRID)
def test_incremental_speed_equals_dense_reference(tiny, tiny_engine, lcut, anchors, deep, selfonly):
    name, count = anchors
    ids = random_prompt(45, seed=lcut + deep)
    spec = f"speed:lcut={lcut},anchors={name},deep={deep},selfonly={str(selfonly).lower()}"
    policy = make_policy(spec, tiny.shape)
    tokens, logits, _ = greedy_with_logits(tiny_engine, ids, policy, steps=8)
    sequence = torch.tensor(ids + tokens[:-1])
    dense, positions = speed_dense_forward(
        tiny.backbone, sequence, len(ids), lcut, count, deep, selfonly
    )
    dense = dense[positions >= len(ids) - 1]  # the rows that predict new tokens
    assert dense.argmax(-1).tolist() == tokens
    assert torch.allclose(logits, dense, atol=1e-4, rtol=0), (logits - dense).abs().max()


def test_shallow_tokens_are_never_computed_in_upper_layers(tiny, tiny_engine, monkeypatch):
    """Count the rows each layer's q/k/v projection sees: upper layers get anchors + deep only."""
    seen = {}
    original = tiny.backbone.before_attention

    def counting_qkv(layer, h, cos, sin, prefill=False):
        seen[layer] = seen.get(layer, 0) + h.shape[-2]
        return original(layer, h, cos, sin, prefill)

    monkeypatch.setattr(tiny.backbone, "before_attention", counting_qkv)
    policy = make_policy("speed:lcut=2,anchors=sink:4,deep=3", tiny.shape)
    tiny_engine.prefill_ids(random_prompt(50), policy)
    assert [seen[layer] for layer in range(6)] == [50, 50, 4 + 3, 4 + 3, 4 + 3, 4 + 3]


def test_prefill_chunk_size_does_not_change_results(tiny):
    from speedkv.core.engine import Engine

    ids = random_prompt(70)
    policy = make_policy("speed:lcut=3,anchors=bos,deep=3", tiny.shape)
    a = greedy_with_logits(Engine(tiny, chunk_size=5), ids, policy, 4)[1]
    b = greedy_with_logits(Engine(tiny, chunk_size=4096), ids, policy, 4)[1]
    assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("lcut, anchors, deep, stride", [(2, 1, 1, 8), (3, 4, 4, 5), (0, 0, 1, 2)])
def test_strided_speed_equals_dense_reference(tiny, tiny_engine, lcut, anchors, deep, stride):
    """`stride=S` keeps every S-th prompt position at full depth as well: the engine's
    upper layers hold exactly those rows and it decodes as the dense reference does."""
    name = {0: "none", 1: "bos", 4: "sink:4"}[anchors]
    ids = random_prompt(45, seed=stride)
    policy = make_policy(
        f"speed:lcut={lcut},anchors={name},deep={deep},stride={stride}", tiny.shape
    )
    assert policy.spec().endswith(f",stride={stride}")
    tokens, logits, _ = greedy_with_logits(tiny_engine, ids, policy, steps=8)
    sequence = torch.tensor(ids + tokens[:-1])
    dense, positions = speed_dense_forward(
        tiny.backbone, sequence, len(ids), lcut, anchors, deep, False, stride
    )
    dense = dense[positions >= len(ids) - 1]
    assert dense.argmax(-1).tolist() == tokens
    assert torch.allclose(logits, dense, atol=1e-4, rtol=0), (logits - dense).abs().max()
    strided = len([p for p in range(anchors, len(ids) - deep) if p % stride == stride - 1])
    lengths = tiny_engine.prefill(ids, policy.spec()).cache.lengths()
    upper = anchors + strided + deep
    assert lengths == [len(ids)] * lcut + [upper] * (tiny.shape.num_layers - lcut)


MASKED = [
    "speed:lcut=3,anchors=bos,deep=3,selfonly=true",  # upper layers attend by a visibility rule
    "speed:lcut=2,anchors=sink:4,stride=3,selfonly=true",
    "pop:lcut=3",  # upper K/V projected from the rows that left, chunk by chunk
]


@pytest.mark.parametrize("spec", MASKED)
def test_masked_attention_chunks_do_not_change_results(tiny, spec):
    """Layers that attend through a mask go `Chunks.masked` queries at a time, apart from the
    rows' chunks: any split gives the one-call result."""
    from speedkv.core.engine import Engine

    ids = random_prompt(70)
    policy = make_policy(spec, tiny.shape)
    whole = greedy_with_logits(Engine(tiny, chunk_size=4096), ids, policy, 4)[1]
    for rows, masked in [(64, 7), (8, 64), (5, 5)]:
        engine = Engine(tiny, chunk_size=4096)
        engine.chunks = Chunks(rows, masked)
        split = greedy_with_logits(engine, ids, make_policy(spec, tiny.shape), 4)[1]
        assert torch.allclose(whole, split, atol=1e-5), (rows, masked)


def test_chunk_sizes_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        Chunks(0, 1024)
