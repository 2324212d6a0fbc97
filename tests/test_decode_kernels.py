"""The decode step's fused pieces against what they replace: decode attention against a
float64 reference, fused projections against the separate layers (no extra weight memory, the
model's own forward unchanged, stale fusions rebuilt), the fused RMSNorm against the module."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speedkv.core import attention
from speedkv.core.engine import Engine, Request
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.hf.backbone import rms_norm
from speedkv.hf.fused import FusedProjection
from speedkv.hf.int8 import Int8Linear

from conftest import random_prompt, tiny_model
from helpers import greedy_with_logits, hf_generate


def reference_decode_attention(q, k, v):
    heads, kv_heads = q.shape[0], k.shape[0]
    packed = q.reshape(1, kv_heads, heads // kv_heads, q.shape[-1]).double()
    out = F.scaled_dot_product_attention(packed, k[None].double(), v[None].double())
    return out.reshape(heads, 1, q.shape[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 2048, 4099])
def test_decode_attention_equals_reference(dtype, n):  # below and above MATMUL_FROM
    torch.manual_seed(0)
    # a cache buffer with room left, as the engine holds it: k, v are strided views
    k = torch.randn(3, n + 16, 64, dtype=dtype)[:, :n]
    v = torch.randn(3, n + 16, 64, dtype=dtype)[:, :n]
    q = torch.randn(9, 1, 64, dtype=dtype)
    got = attention.decode_attention(q, k, v)
    assert got.shape == (9, 1, 64) and got.dtype == dtype
    # bf16: the fused kernel keeps scores in float32; the matrix products round them to bf16
    # as transformers' eager attention does
    bf16_tolerance = 4e-3 if n < attention.MATMUL_FROM else 2e-2
    tolerance = 1e-6 if dtype == torch.float32 else bf16_tolerance
    assert (got.double() - reference_decode_attention(q, k, v)).abs().max() < tolerance


def storage_bytes(module: nn.Module) -> int:
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()
    }
    return sum(storages.values())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["linear", "int8"])
def test_fused_projection_equals_separate_layers_without_extra_memory(kind, bias):
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(32, out, bias=bias) for out in (48, 16, 16))
    if kind == "int8":
        layers = nn.ModuleList(Int8Linear(layer) for layer in layers)
    layers.requires_grad_(False)
    before = storage_bytes(layers)
    x = torch.randn(3, 5, 32)
    expected = torch.cat([layer(x) for layer in layers], -1)
    fused = FusedProjection(list(layers))
    assert fused.sizes == [48, 16, 16]
    assert torch.allclose(fused(x), expected, atol=1e-6)
    # every part now reads its rows of one stack: the same bytes, and the parts still compute
    # what they did (the model's own forward is unchanged)
    assert storage_bytes(layers) == before
    assert len({p.untyped_storage().data_ptr() for p in layers.parameters()}) == (
        3 if bias else 2
    ) - (kind == "linear")
    assert torch.allclose(torch.cat([layer(x) for layer in layers], -1), expected, atol=1e-6)


def test_fused_projection_runs_trainable_or_wrapped_layers_one_by_one():
    torch.manual_seed(0)
    trainable = [nn.Linear(8, 4), nn.Linear(8, 4)]  # requires grad: training must see them
    fused = FusedProjection(trainable)
    x = torch.randn(2, 8)
    assert torch.equal(fused(x), torch.cat([m(x) for m in trainable], -1))
    assert trainable[0].weight.untyped_storage().data_ptr() != (
        trainable[1].weight.untyped_storage().data_ptr()
    )
    wrapped = [nn.Sequential(nn.Linear(8, 4)), nn.Linear(8, 4)]  # not a plain layer
    wrapped[0].out_features = 4
    fused = FusedProjection(wrapped)
    assert torch.equal(fused(x), torch.cat([m(x) for m in wrapped], -1))


def test_engine_follows_weights_replaced_after_fusion():
    """A fusion is rebuilt when a layer's weight is replaced (an adapter merged, new weights
    loaded): the engine must compute with the weights the model has now."""
    model = tiny_model("llama")
    engine = Engine(model)
    policy = make_policy("full", model.shape)
    ids = random_prompt(12)
    greedy_with_logits(engine, ids, policy.fresh(), 4)  # fuses every layer
    attn = model.hf_model.model.layers[2].self_attn
    attn.k_proj.weight = nn.Parameter(torch.randn_like(attn.k_proj.weight) * 3, requires_grad=False)
    tokens, _, _ = greedy_with_logits(engine, ids, policy.fresh(), 6)
    assert tokens == hf_generate(model.hf_model, ids, 6, min_new_tokens=6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_equals_the_module(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(4, 3, 64, dtype=dtype) * 5
    expected = norm(x)
    got = rms_norm(norm, x)
    assert got.dtype == expected.dtype
    if dtype == torch.float32:
        assert torch.allclose(got, expected, atol=1e-6, rtol=1e-6)
    else:  # the same float32 value rounded once: at most one bfloat16 step apart
        assert torch.allclose(got.float(), expected.float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_decode_equals_plain_weights(family, dtype):
    """--prepack decodes with oneDNN's copy of the weights: the same tokens and logits (float32
    within rounding), for full attention and SPEED, batched with different lengths."""
    model = tiny_model(family)
    model.hf_model.to(dtype)
    engine = Engine(model)
    specs = ["full", "speed:lcut=3,anchors=bos", "speed:lcut=4,anchors=none,deep=3"]
    prompts = [random_prompt(n, seed=n) for n in (9, 23, 40)]

    def run():
        sampling = SamplingParams(max_new_tokens=6, ignore_eos=True)
        requests = [
            Request(ids, make_policy(spec, model.shape), sampling)
            for ids in prompts
            for spec in specs
        ]
        return [g.output_ids for g in engine.generate(requests)]

    def logits(spec):
        return greedy_with_logits(engine, prompts[1], make_policy(spec, model.shape), 5)[1]

    plain, plain_rows = run(), [logits(s) for s in specs]
    engine = Engine(model, prepack=True)
    packed_layer = model.backbone.decode_weights()[0]
    assert packed_layer is not None and packed_layer.qkv[0].is_mkldnn
    assert run() == plain
    for spec, rows in zip(specs, plain_rows):
        tolerance = 1e-4 if dtype == torch.float32 else 0.0
        assert (logits(spec) - rows).abs().max() <= tolerance, spec
