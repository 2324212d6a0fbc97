"""kv_bytes is counted from the tensors that exist and equals the analytic layer-token count."""

import pytest
import torch

from speedkv.core.engine import Engine, Request
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams

from conftest import EQUIVALENCE_PARAMS, random_prompt, tiny_model

TINY_PARAMS = EQUIVALENCE_PARAMS  # the shared tiny models, Gemma 3 included


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
    if not model.shape.windowed:
        assert result.kv_bytes == analytic(L, lcut, N, A, D, 0, per)
        # the last sampled token is never fed back, so new - 1 decode tokens hold K/V
        assert result.kv_bytes_final == analytic(L, lcut, N, A, D, new - 1, per)
        assert result.layer_lengths == [N] * lcut + [A + D] * (L - lcut)
    else:  # a windowed layer keeps the rows the first new token (at position N) can see
        lengths = []
        for layer in range(L):
            rows = range(N) if layer < lcut else [*range(A), *range(N - D, N)]
            window = model.shape.window(layer)
            first = 0 if window is None else N - window + 1
            lengths.append(sum(p >= first for p in rows))
            # too few decode tokens for a layer to drop again while decoding
            assert window is None or new < max(16, window // 4)
        assert result.layer_lengths == lengths <= [N] * lcut + [A + D] * (L - lcut)
        assert result.kv_bytes == sum(lengths) * per
        assert result.kv_bytes_final == (sum(lengths) + L * (new - 1)) * per
    # buffers are sized for exactly what is kept plus the decode tokens to come
    assert result.kv_allocated_bytes == result.kv_bytes_final


def test_selfonly_keeps_only_anchors_in_upper_layers(tiny, tiny_engine):
    N, new, L = 40, 6, tiny.shape.num_layers
    policy = make_policy("speed:lcut=2,anchors=bos,deep=3,selfonly=true", tiny.shape)
    result = tiny_engine.generate(
        [Request(random_prompt(N), policy, SamplingParams(max_new_tokens=new))]
    )[0]
    per = tiny.shape.kv_bytes_per_token_layer(torch.float32)
    # a windowed layer keeps what the first new token (at position N) sees: in an upper one,
    # the anchor only while it is inside the window
    windows = [tiny.shape.window(layer) for layer in range(L)]
    kept = [N if w is None else min(N, w - 1) for w in windows[:2]]
    kept += [1 if w is None or w > N else 0 for w in windows[2:]]
    assert result.layer_lengths == kept
    assert result.kv_bytes_final == (sum(kept) + 2 * (new - 1)) * per


def test_prefill_work_counts_and_flops(tiny, tiny_engine):
    """Rows and query-key pairs each layer computes, and the FLOPs counted from them; in a
    layer with a sliding window (Gemma 3's local layers) a query pairs only with the keys
    inside its window."""
    from speedkv.core.flops import head_flops, layer_weights, pair_flops

    N, L = 33, tiny.shape.num_layers
    windows = [tiny.shape.window(layer) for layer in range(L)]

    def sees(t, layer, k=None):  # keys a query at t pairs with: all of 0..t, or key k alone
        w = windows[layer]
        if k is not None:
            return int(w is None or t - k < w)
        return t + 1 if w is None else min(t + 1, w)

    full = tiny_engine.prefill_ids(random_prompt(N), make_policy("full", tiny.shape))
    full_pairs = [sum(sees(t, layer) for t in range(N)) for layer in range(L)]
    assert full.rows == [N] * L and full.pairs == full_pairs
    speed = tiny_engine.prefill_ids(
        random_prompt(N), make_policy("speed:lcut=4,anchors=bos,deep=1", tiny.shape)
    )
    assert speed.rows == [N] * 4 + [2] * (L - 4)
    # BoS sees itself; the last token itself and BoS (where its window reaches back that far)
    assert speed.pairs == full_pairs[:4] + [2 + sees(N - 1, i, 0) for i in range(4, L)]
    selfonly = make_policy("speed:lcut=4,anchors=bos,deep=3,selfonly=true", tiny.shape)
    assert tiny_engine.prefill_ids(random_prompt(N), selfonly).pairs[4:] == [
        1 + sum(1 + sees(t, layer, 0) for t in range(N - 3, N)) for layer in range(4, L)
    ]
    result = tiny_engine.generate(
        [
            Request(
                random_prompt(N), make_policy("full", tiny.shape), SamplingParams(max_new_tokens=4)
            )
        ]
    )[0]
    per_layer = 2 * layer_weights(tiny.shape)
    assert result.flops_prefill == L * per_layer * N + pair_flops(tiny.shape) * sum(
        full_pairs
    ) + head_flops(tiny.shape)
    # three decode steps, each also sees itself
    reads = sum(sees(t, layer) for layer in range(L) for t in (N, N + 1, N + 2))
    assert (
        result.flops_decode
        == 3 * (per_layer * L + head_flops(tiny.shape)) + pair_flops(tiny.shape) * reads
    )
