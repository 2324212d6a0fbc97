"""Weight-only int8 (`--weights int8`): the layer against its own dequantized weight, the engine
on a quantized model against transformers' generate and the dense SPEED reference of the same
quantized model, exact weight bytes, and bad input."""

import json

import pytest
import torch

from speedkv.analysis.dense import speed_dense_forward
from speedkv.core.engine import Engine, Request
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.errors import UserError
from speedkv.hf.int8 import Int8Linear
from speedkv.hf.loading import quantize_int8, with_weights
from speedkv.kernels.int8 import KERNEL_MAX_ROWS

from conftest import random_prompt, tiny_model
from helpers import greedy_with_logits, hf_generate, run_cli


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def quantized(request):
    return quantize_int8(tiny_model(request.param))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 40])
def test_int8_linear_computes_with_its_dequantized_weight(dtype, rows):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True).to(dtype)
    layer = Int8Linear(linear)
    weight = layer.dequantized(torch.float32)
    # rounding to the nearest step moves no entry by more than half its row's step; a bfloat16
    # scale is itself rounded (relative 2**-8, times up to 127 steps), up to another half
    step = layer.scale.float()[:, None]
    bound = step / 2 if dtype == torch.float32 else step
    assert ((weight - linear.weight.float()).abs() <= bound + 1e-6).all()
    x = torch.randn(2, rows, 64, dtype=dtype)
    expected = x.float() @ weight.T + layer.bias.float()
    got = layer(x)
    assert got.shape == (2, rows, 48) and got.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 0.15
    assert torch.allclose(got.float(), expected, atol=tolerance, rtol=0.02)


def test_quantizing_leaves_the_model_as_it_was_and_halves_what_decode_reads(tiny):
    before = {k: v.clone() for k, v in tiny.hf_model.state_dict().items()}
    quantized = quantize_int8(tiny)
    assert all(torch.equal(v, before[k]) for k, v in tiny.hf_model.state_dict().items())
    linears = [m for m in quantized.hf_model.modules() if isinstance(m, torch.nn.Linear)]
    assert not linears  # every linear layer, the LM head included, became Int8Linear
    assert quantized.name == f"{tiny.name}+int8"
    # float32 weights (4 bytes) become int8 (1 byte) plus one float32 scale per output row
    native = quantized_bytes = 0
    for module in tiny.hf_model.modules():
        if isinstance(module, torch.nn.Linear):
            native += module.weight.numel() * 4
            quantized_bytes += module.weight.numel() + module.out_features * 4
    saved = tiny.backbone.decode_weight_bytes() - quantized.backbone.decode_weight_bytes()
    assert saved == native - quantized_bytes


@pytest.mark.parametrize("n", [1, 37])
def test_engine_on_int8_weights_equals_hf_generate_of_the_same_weights(quantized, n):
    ids = random_prompt(n)
    expected = hf_generate(quantized.hf_model, ids, 10, min_new_tokens=10)
    engine = Engine(quantized, chunk_size=16)
    L = quantized.shape.num_layers
    for spec in ("full", f"speed:lcut={L},anchors=bos,deep=1"):
        request = Request(
            ids, make_policy(spec, quantized.shape), SamplingParams(max_new_tokens=10)
        )
        assert engine.generate([request])[0].output_ids == expected, spec


def test_speed_on_int8_weights_equals_the_dense_reference(quantized):
    ids = random_prompt(45, seed=3)
    policy = make_policy("speed:lcut=3,anchors=bos,deep=1", quantized.shape)
    tokens, logits, _ = greedy_with_logits(Engine(quantized, chunk_size=16), ids, policy, steps=6)
    sequence = torch.tensor(ids + tokens[:-1])
    dense, positions = speed_dense_forward(quantized.backbone, sequence, len(ids), 3, 1, 1, False)
    dense = dense[positions >= len(ids) - 1]
    assert dense.argmax(-1).tolist() == tokens
    assert torch.allclose(logits, dense, atol=1e-4, rtol=0), (logits - dense).abs().max()


def test_unknown_weights_are_refused(tiny):
    assert with_weights(tiny, "native") is tiny
    with pytest.raises(UserError, match="weights must be one of native, int8, got 'int4'"):
        with_weights(tiny, "int4")


def test_cli_takes_weights_int8_and_refuses_others(smollm2, monkeypatch, capsys):
    args = ["generate", "Name a river.", "-n", "3", "--weights", "int8", "--json"]
    code, out, err = run_cli(args, monkeypatch, capsys, model=smollm2)
    assert code == 0, err
    assert len(json.loads(out)["output_ids"]) == 3
    assert "(int8 weights)" in err
    code, _, err = run_cli(["generate", "hi", "--weights", "int4"], monkeypatch, capsys)
    assert code == 2
    assert "weights must be one of native, int8, got 'int4'" in err
