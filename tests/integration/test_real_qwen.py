"""The embedded Qwen2.5-Coder-0.5B in float32: the Qwen2 path of a real model (biased q/k/v,
tied embeddings, a tokenizer that adds no BoS token) against HF greedy and the dense reference."""

import pytest

from speedkv.core.engine import Engine
from speedkv.core.registry import make_policy
from speedkv.errors import UserError
from speedkv.methods.speed import NO_BOS_DEFAULT, parse_anchors

from helpers import check_equals_dense, check_equals_hf_generate, document_prompt_ids

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
    return document_prompt_ids(qwen.tokenizer, 300, "What is the text above about?")


def test_qwen_prompts_have_no_bos_so_bos_anchors_are_refused(qwen, prompt_ids):
    assert not qwen.shape.starts_with_bos
    assert prompt_ids[0] != qwen.tokenizer.bos_token_id
    with pytest.raises(UserError, match="do not begin with one"):
        make_policy("speed:lcut=18,anchors=bos,deep=1", qwen.shape)
    default = make_policy("speed:lcut=18,deep=1", qwen.shape)
    assert default.config.anchors == NO_BOS_DEFAULT
    assert default.rule.anchors == parse_anchors(NO_BOS_DEFAULT)


def test_full_and_uncut_speed_equal_hf_generate(engine, prompt_ids):
    specs = ["full", "speed:lcut=24,anchors=first,deep=1", "speed:lcut=24,anchors=none,deep=1"]
    check_equals_hf_generate(engine, prompt_ids, specs, steps=12)


@pytest.mark.parametrize(
    "spec",
    [
        "speed:lcut=18,deep=1",
        "speed:lcut=21,anchors=sink:4,deep=1",
        "speed:lcut=12,anchors=none,deep=1",
    ],
)
def test_speed_equals_dense_reference(engine, prompt_ids, spec):
    check_equals_dense(engine, prompt_ids, spec, steps=6, atol=1e-3)
