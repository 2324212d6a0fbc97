"""The Qwen2 architecture in vLLM (q/k/v with bias): a small random Qwen2 checkpoint, stock and
SPEED, against speedkv's own engine on the same weights (float32, greedy)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from speedkv import Engine, Request, SamplingParams, make_policy
from speedkv.vllm.args import engine_args

from conftest import run_vllm

LENGTHS = [1, 3, 40, 129, 300, 700]
NEW = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random 6-layer Qwen2 whose head size vLLM's CPU kernel supports (32), its weights
    scaled so greedy choices are decisive, saved as an HF directory."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None)  # fmt: skip
    model = Qwen2ForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(directory)
    return directory, model


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in LENGTHS]


def reference(model, method: str, prompts) -> list[list[int]]:
    engine = Engine.from_hf(model)
    policy = lambda: make_policy(method, engine.shape)  # noqa: E731
    sampling = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    return [
        g.output_ids for g in engine.generate([Request(p, policy(), sampling) for p in prompts])
    ]


@pytest.mark.parametrize("method", ["full", "speed:lcut=4,anchors=bos,deep=1",
                                    "speed:lcut=2,anchors=sink:2,deep=3"])  # fmt: skip
def test_qwen2_equals_the_engine(checkpoint, prompts, method):
    directory, model = checkpoint
    args = engine_args(method, directory)
    if method != "full":
        assert args["hf_overrides"]["architectures"] == ["SpeedQwen2ForCausalLM"]
    run = run_vllm(directory, prompts, NEW, skip_tokenizer_init=True,
                   max_num_batched_tokens=256, **args)  # fmt: skip
    assert run.tokens == reference(model, method, prompts)
