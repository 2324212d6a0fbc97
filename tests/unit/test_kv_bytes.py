"""kv_bytes is counted from the tensors that exist and equals the analytic layer-token count."""

import pytest
import torch

from speedkv.core.engine import Engine, Request
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams

from conftest import random_prompt, tiny_model


def analytic(L, lcut, N, A, D, g, per_token_layer):
    """(lcut * (N + g) + (L - lcut) * (A + D + g)) * bytes; g = decode tokens in the cache."""
    return (lcut * (N + g) + (L - lcut) * (A + D + g)) * per_token_layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lcut, anchors, A, D",
    [(6, "bos", 1, 1), (4, "bos", 1, 1), (0, "none", 0, 1), (3, "sink:4", 4, 5), (5, "none", 0, 3)],
)
def test_kv_bytes_match_the_analytic_count(tiny, lcut, anchors, A, D, dtype):
    model = tiny
    if dtype != torch.float32:  # a model of our own: the session's `tiny` stays float32
        model = tiny_model(tiny.shape.model_type)
        model.hf_model.to(dtype)
    engine = Engine(model, chunk_size=16)
    N, new = 57, 9
    policy = make_policy(f"speed:lcut={lcut},anchors={anchors},deep={D}", model.shape)
    sampling = SamplingParams(max_new_tokens=new, ignore_eos=True)
    result = engine.generate([Request(random_prompt(N), policy, sampling)])[0]
    per = model.shape.kv_bytes_per_token_layer(dtype)
    assert per == 2 * 2 * 16 * (4 if dtype == torch.float32 else 2)
    assert model.dtype == dtype
    L = model.shape.num_layers
    assert result.kv_bytes == analytic(L, lcut, N, A, D, 0, per)
    # the last sampled token is never fed back, so new - 1 decode tokens hold K/V
    assert result.kv_bytes_final == analytic(L, lcut, N, A, D, new - 1, per)
    assert result.layer_lengths == [N] * lcut + [A + D] * (L - lcut)
    # buffers are sized for exactly what is kept plus the decode tokens to come
    assert result.kv_allocated_bytes == result.kv_bytes_final


def test_selfonly_keeps_only_anchors_in_upper_layers(tiny, tiny_engine):
    N, new, L = 40, 6, tiny.shape.num_layers
    policy = make_policy("speed:lcut=2,anchors=bos,deep=3,selfonly=true", tiny.shape)
    result = tiny_engine.generate(
        [Request(random_prompt(N), policy, SamplingParams(max_new_tokens=new))]
    )[0]
    per = tiny.shape.kv_bytes_per_token_layer(torch.float32)
    assert result.layer_lengths == [N, N] + [1] * (L - 2)
    assert result.kv_bytes_final == (2 * (N + new - 1) + (L - 2) * 1) * per


def test_prefill_work_counts_and_flops(tiny, tiny_engine):
    from speedkv.core.flops import head_flops, layer_weights, pair_flops

    N, L = 33, tiny.shape.num_layers
    full = tiny_engine.prefill_ids(random_prompt(N), make_policy("full", tiny.shape))
    assert full.rows == [N] * L and full.pairs == [N * (N + 1) // 2] * L
    speed = tiny_engine.prefill_ids(
        random_prompt(N), make_policy("speed:lcut=4,anchors=bos,deep=1", tiny.shape)
    )
    assert speed.rows == [N] * 4 + [2] * (L - 4)
    assert speed.pairs == [N * (N + 1) // 2] * 4 + [3] * (L - 4)  # BoS sees itself; last sees both
    selfonly = make_policy("speed:lcut=4,anchors=bos,deep=3,selfonly=true", tiny.shape)
    assert tiny_engine.prefill_ids(random_prompt(N), selfonly).pairs[4:] == [1 + 2 + 2 + 2] * (
        L - 4
    )
    result = tiny_engine.generate(
        [
            Request(
                random_prompt(N), make_policy("full", tiny.shape), SamplingParams(max_new_tokens=4)
            )
        ]
    )[0]
    per_layer = 2 * layer_weights(tiny.shape)
    assert result.flops_prefill == L * (
        per_layer * N + pair_flops(tiny.shape) * N * (N + 1) // 2
    ) + head_flops(tiny.shape)
    reads = L * ((N + 1) + (N + 2) + (N + 3))  # three decode steps, each also sees itself
    assert (
        result.flops_decode
        == 3 * (per_layer * L + head_flops(tiny.shape)) + pair_flops(tiny.shape) * reads
    )
