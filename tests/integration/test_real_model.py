"""The embedded SmolLM2-135M, loaded once in float32: the same checks as on tiny models."""

import pytest

from speedkv.core.engine import Engine, Request
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.hf.text import encode_prompt

from helpers import check_equals_dense, check_equals_hf_generate, document_prompt_ids

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def engine(smollm2):
    return Engine(smollm2, chunk_size=256)


@pytest.fixture(scope="module")
def document_ids(smollm2):
    return document_prompt_ids(smollm2.tokenizer, 420, "Summarise the text above in one sentence.")


def test_full_and_uncut_speed_equal_hf_generate(engine, document_ids):
    check_equals_hf_generate(engine, document_ids, ["full", "speed:lcut=30,anchors=bos,deep=1"], 16)


@pytest.mark.parametrize(
    "spec", ["speed:lcut=22,anchors=bos,deep=1", "speed:lcut=15,anchors=none,deep=1"]
)
def test_speed_equals_dense_reference(engine, document_ids, spec):
    check_equals_dense(engine, document_ids, spec, steps=8, atol=1e-4)


def test_batch_equals_one_by_one(smollm2, engine, document_ids):
    short = encode_prompt(smollm2.tokenizer, "Name three colours.").ids
    specs = ["full", "speed:lcut=22,anchors=bos,deep=1"]

    def make():
        return [
            Request(ids, make_policy(s, smollm2.shape), SamplingParams(max_new_tokens=10))  # noqa: E731
            for ids in (document_ids, short)
            for s in specs
        ]

    batch = engine.generate(make())
    alone = [engine.generate([r])[0] for r in make()]
    assert [g.output_ids for g in batch] == [g.output_ids for g in alone]


def test_stop_strings_and_streaming_text(smollm2, engine):
    request = engine.request(
        "List the days of the week, one per line.",
        "full",
        sampling=SamplingParams(max_new_tokens=40, stop=("Wednesday",)),
    )
    events = list(engine.run([request]))
    final = events[-1].finished
    assert final.finish_reason == "stop"
    assert "Tuesday" in final.text and "Wednesday" not in final.text
    assert "".join(e.text for e in events) == final.text
