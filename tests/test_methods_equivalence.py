"""Every peer method reduces to `full` exactly at its degenerate setting, and its kv_bytes
are exact for its policy."""

import math

import pytest
import torch

from speedkv.core.engine import Request
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams

from conftest import random_prompt
from helpers import greedy_with_logits

N, NEW = 80, 8

DEGENERATE = [
    "pop:lcut=6",
    "swiftkv:k=6",
    "swiftkv:k=6,acrosskv=2",
    "fastkv:tsp_rate=1,retain=1",
    "fastkv:tsp_layer=5,tsp_rate=80,retain=80",  # token budgets >= the prompt
    "specprefill:keep=1",
    "snapkv:retain=1",
    "snapkv:retain=80,gqa=true",
    "streamingllm:window=1",
    f"streamingllm:sink=0,window={N + NEW}",  # a fixed cap covering prompt and new tokens
    "h2o:heavy=1,recent=1",
    f"h2o:heavy={N + NEW},recent=4",
    "gemfilter:retain=1,filter_layer=5",
    "pyramidinfer:decay=1",
]


@pytest.mark.parametrize("spec", DEGENERATE)
def test_degenerate_settings_reduce_to_full(tiny, tiny_engine, spec):
    ids = random_prompt(N, seed=3)
    full_tokens, full_logits, _ = greedy_with_logits(
        tiny_engine, ids, make_policy("full", tiny.shape), NEW
    )
    tokens, logits, _ = greedy_with_logits(tiny_engine, ids, make_policy(spec, tiny.shape), NEW)
    assert tokens == full_tokens
    assert torch.allclose(logits, full_logits, atol=1e-4, rtol=0)


def run(engine, shape, spec, n=N, new=NEW):
    policy = make_policy(spec, shape)
    sampling = SamplingParams(max_new_tokens=new, ignore_eos=True)
    return engine.generate([Request(random_prompt(n, seed=5), policy, sampling)])[0]


def per_entry(tiny):
    return tiny.shape.kv_bytes_per_token_layer(torch.float32)


@pytest.mark.parametrize(
    "spec, entries_first, entries_final",
    [
        # (prompt entries per layer x layers) at the first token and at the end; g = NEW - 1
        ("pop:lcut=3", 6 * N, 6 * (N + NEW - 1)),
        ("swiftkv:k=2", 6 * N, 6 * (N + NEW - 1)),
        (
            "swiftkv:k=2,acrosskv=2",
            (2 + 2) * N,
            (2 + 2) * (N + NEW - 1),
        ),  # 4 upper layers, 2 caches
        (
            "swiftkv:k=1,acrosskv=3",
            (1 + 2) * N,
            (1 + 2) * (N + NEW - 1),
        ),  # 5 upper layers: groups 3+2
        ("fastkv:tsp_layer=2,tsp_rate=0.5,retain=0.25,window=4", 6 * 20, 6 * (20 + NEW - 1)),
        ("fastkv:tsp_layer=2,tsp_rate=40,retain=10,window=4", 6 * 10, 6 * (10 + NEW - 1)),
        ("specprefill:keep=0.3,chunk=8", 6 * 24, 6 * (24 + NEW - 1)),  # ceil(10 chunks * 0.3) = 3
        ("specprefill:keep=0.3,chunk=8,force_last=4", 6 * 28, 6 * (28 + NEW - 1)),
        ("gemfilter:retain=0.3,filter_layer=2", 6 * 24, 6 * (24 + NEW - 1)),
        ("gemfilter:retain=17,filter_layer=2", 6 * 17, 6 * (17 + NEW - 1)),
        ("snapkv:retain=0.3,window=8,gqa=true", 6 * 24, 6 * (24 + NEW - 1)),
        ("snapkv:retain=0.3,window=8", 2 * 6 * 24, 2 * 6 * (24 + NEW - 1)),  # per query head: x2
        ("streamingllm:sink=4,window=16", 6 * 20, 6 * 20),  # a fixed cap, held during decode
        ("h2o:heavy=10,recent=6", 6 * 16, 6 * 16),
        ("h2o:heavy=0.1,recent=0.1", 6 * 16, 6 * (int(0.1 * (N + NEW - 1)) * 2)),  # grows with seen
    ],
)
def test_kv_bytes_are_exact_for_each_method(tiny, tiny_engine, spec, entries_first, entries_final):
    result = run(tiny_engine, tiny.shape, spec)
    assert result.kv_bytes == entries_first * per_entry(tiny)
    assert result.kv_bytes_final == entries_final * per_entry(tiny)


def test_pyramidinfer_bytes_follow_its_schedule(tiny, tiny_engine):
    spec = "pyramidinfer:recent=8,decay=0.5,min_context=4,sink=2"
    policy = make_policy(spec, tiny.shape)
    L, d = tiny.shape.num_layers, 0.5
    context, expected = N - 8, []
    for layer in range(L):
        if layer > 0:
            ratio = (1 - d) * (math.cos(math.pi * layer / L) + 1) / 2 + d
            keep = int(context * ratio)
            if context > 4 and 4 < keep < context:
                context = keep
        expected.append(context + 8)
    result = run(tiny_engine, tiny.shape, spec)
    assert result.layer_lengths == expected
    assert result.kv_bytes == sum(expected) * per_entry(tiny)
    assert policy.ratio(0) == 1.0 and policy.ratio(L) == pytest.approx(d)


PEERS = ["pop", "swiftkv", "fastkv", "specprefill", "gemfilter", "snapkv", "streamingllm",
         "h2o", "pyramidinfer", "speed:lcut=4", "speed:lcut=4,anchors=none"]  # fmt: skip


@pytest.mark.parametrize("spec", PEERS)
@pytest.mark.parametrize("n", [1, 2, 9, 40])
def test_short_prompts_generate_at_default_settings(tiny, tiny_engine, spec, n):
    # prompts no longer than a method's observation window or budget (chat-sized questions)
    # must still decode; FastKV once failed here with an empty window-score tensor
    out = run(tiny_engine, tiny.shape, spec, n=n, new=4)
    assert len(out.output_ids) == 4 and out.kv_bytes > 0
