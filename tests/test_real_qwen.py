"""The embedded Qwen2.5-Coder-0.5B in float32: the Qwen2 path of a real model (biased q/k/v,
tied embeddings, a tokenizer that adds no BoS token) against HF greedy and the dense reference."""

import pytest
import torch

from speedkv.analysis.dense import speed_dense_forward
from speedkv.core.engine import Engine, Request
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.errors import UserError
from speedkv.hf.text import encode_prompt
from speedkv.methods.speed import NO_BOS_DEFAULT, parse_anchors
from speedkv.prompts.haystack import haystack_text

from helpers import greedy_with_logits

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def qwen():
    from speedkv.hf.loading import EMBEDDED, load_model

    if EMBEDDED["qwen2.5-coder-0.5b"].part_paths() is None:
        pytest.skip("the embedded Qwen2.5 is not installed (speedkv models --install)")
    return load_model("qwen2.5-coder-0.5b", dtype="float32", device="cpu", progress=False)


@pytest.fixture(scope="module")
def engine(qwen):
    return Engine(qwen, chunk_size=128)


@pytest.fixture(scope="module")
def prompt_ids(qwen):
    text = haystack_text(qwen.tokenizer, 300) + "\n\nWhat is the text above about?"
    return encode_prompt(qwen.tokenizer, text).ids


def test_qwen_prompts_have_no_bos_so_bos_anchors_are_refused(qwen, prompt_ids):
    assert not qwen.shape.starts_with_bos
    assert prompt_ids[0] != qwen.tokenizer.bos_token_id
    with pytest.raises(UserError, match="do not begin with one"):
        make_policy("speed:lcut=18,anchors=bos", qwen.shape)
    default = make_policy("speed:lcut=18", qwen.shape)
    assert default.config.anchors == NO_BOS_DEFAULT
    assert default.rule.anchors == parse_anchors(NO_BOS_DEFAULT)


def test_full_and_uncut_speed_equal_hf_generate(qwen, engine, prompt_ids):
    steps = 12
    out = qwen.hf_model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
    )
    expected = out[0, len(prompt_ids) :].tolist()
    for spec in ("full", "speed:lcut=24,anchors=first", "speed:lcut=24,anchors=none"):
        request = Request(
            prompt_ids,
            make_policy(spec, qwen.shape),
            SamplingParams(max_new_tokens=steps, ignore_eos=True),
        )
        assert engine.generate([request])[0].output_ids == expected, spec


@pytest.mark.parametrize(
    "spec, lcut, anchors",
    [
        ("speed:lcut=18", 18, parse_anchors(NO_BOS_DEFAULT)),
        ("speed:lcut=21,anchors=sink:4", 21, 4),
        ("speed:lcut=12,anchors=none", 12, 0),
    ],
)
def test_speed_equals_dense_reference(qwen, engine, prompt_ids, spec, lcut, anchors):
    policy = make_policy(spec, qwen.shape)
    tokens, logits, _ = greedy_with_logits(engine, prompt_ids, policy, steps=6)
    ids = torch.tensor(prompt_ids + tokens[:-1])
    dense, positions = speed_dense_forward(qwen.backbone, ids, len(prompt_ids), lcut, anchors)
    dense = dense[positions >= len(prompt_ids) - 1]
    assert dense.argmax(-1).tolist() == tokens
    assert (logits - dense).abs().max() < 1e-3
