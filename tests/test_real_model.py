"""The embedded SmolLM2-135M, loaded once in float32: the same checks as on tiny models."""

import pytest
import torch

from speedkv.analysis.dense import speed_dense_forward
from speedkv.core.engine import Engine, Request
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.hf.text import encode_prompt
from speedkv.prompts.haystack import haystack_text

from helpers import greedy_with_logits

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def engine(smollm2):
    return Engine(smollm2, chunk_size=256)


@pytest.fixture(scope="module")
def document_ids(smollm2):
    text = haystack_text(smollm2.tokenizer, 420) + "\n\nSummarise the text above in one sentence."
    return encode_prompt(smollm2.tokenizer, text).ids


def test_full_and_uncut_speed_equal_hf_generate(smollm2, engine, document_ids):
    steps = 16
    out = smollm2.hf_model.generate(
        torch.tensor([document_ids]),
        attention_mask=torch.ones(1, len(document_ids), dtype=torch.long),
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
    )
    expected = out[0, len(document_ids) :].tolist()
    for spec in ("full", "speed:lcut=30,anchors=bos"):
        request = Request(
            document_ids,
            make_policy(spec, smollm2.shape),
            SamplingParams(max_new_tokens=steps, ignore_eos=True),
        )
        assert engine.generate([request])[0].output_ids == expected, spec


@pytest.mark.parametrize(
    "spec, lcut, anchors",
    [("speed:lcut=22,anchors=bos", 22, 1), ("speed:lcut=15,anchors=none", 15, 0)],
)
def test_speed_equals_dense_reference(smollm2, engine, document_ids, spec, lcut, anchors):
    policy = make_policy(spec, smollm2.shape)
    tokens, logits, _ = greedy_with_logits(engine, document_ids, policy, steps=8)
    dense, positions = speed_dense_forward(
        smollm2.backbone, torch.tensor(document_ids + tokens[:-1]), len(document_ids), lcut, anchors
    )
    dense = dense[positions >= len(document_ids) - 1]
    assert dense.argmax(-1).tolist() == tokens
    assert (logits - dense).abs().max() < 1e-4


def test_batch_equals_one_by_one(smollm2, engine, document_ids):
    short = encode_prompt(smollm2.tokenizer, "Name three colours.").ids
    specs = ["full", "speed:lcut=22,anchors=bos"]

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
