"""The embedded Qwen2.5-Coder-1.5B (28 layers, 12/2 heads) in float32, where it is installed
(`make qwen-1.5b`): full attention is transformers' greedy, SPEED at 75 % depth (21 of 28) is the
dense reference."""

import pytest

from speedkv.core.engine import Engine

from helpers import check_equals_dense, check_equals_hf_generate, document_prompt_ids

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def engine():
    from speedkv.hf.loading import EMBEDDED, load_model

    if EMBEDDED["qwen2.5-coder-1.5b"].part_paths() is None:
        pytest.skip("the embedded Qwen2.5-Coder-1.5B is not installed (make qwen-1.5b)")
    model = load_model("qwen2.5-coder-1.5b", dtype="float32", device="cpu", progress=False)
    assert (model.shape.num_layers, model.shape.num_heads, model.shape.num_kv_heads) == (28, 12, 2)
    return Engine(model, chunk_size=128)


@pytest.fixture(scope="module")
def prompt_ids(engine):
    return document_prompt_ids(engine.model.tokenizer, 200, "What is the text above about?")


def test_full_equals_hf_generate(engine, prompt_ids):
    check_equals_hf_generate(engine, prompt_ids, ["full"], steps=6)


def test_speed_at_three_quarters_depth_equals_dense_reference(engine, prompt_ids):
    check_equals_dense(engine, prompt_ids, "speed:lcut=21,deep=1", steps=4, atol=2e-3)
