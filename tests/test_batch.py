"""A batch of prompts of different lengths (and methods) gives what each gives alone."""

from conftest import random_prompt

from speedkv.engine import Request
from speedkv.policy import make_policy
from speedkv.sampling import SamplingParams


def requests(shape, sampling_for):
    specs = [
        "full",
        "speed:lcut=3,anchors=bos",
        "speed:lcut=1,anchors=sink:4,deep=3,selfonly=true",
        "full",
    ]
    lengths = [70, 12, 41, 3]
    return [
        Request(random_prompt(n, seed=i), make_policy(s, shape), sampling_for(i))
        for i, (n, s) in enumerate(zip(lengths, specs, strict=False))
    ]


def test_greedy_batch_equals_one_by_one(tiny, tiny_engine):
    def sampling(i):
        return SamplingParams(max_new_tokens=5 + 3 * i)

    batch = tiny_engine.generate(requests(tiny.shape, sampling))
    alone = [tiny_engine.generate([r])[0] for r in requests(tiny.shape, sampling)]
    assert [g.output_ids for g in batch] == [g.output_ids for g in alone]
    assert [g.kv_bytes_final for g in batch] == [g.kv_bytes_final for g in alone]
    assert [len(g.output_ids) for g in batch] == [5, 8, 11, 14]


def test_seeded_sampling_batch_equals_one_by_one(tiny, tiny_engine):
    def sampling(i):
        return SamplingParams(max_new_tokens=10, temperature=0.9, top_k=20, top_p=0.9, seed=100 + i)

    batch = tiny_engine.generate(requests(tiny.shape, sampling))
    alone = [tiny_engine.generate([r])[0] for r in requests(tiny.shape, sampling)]
    assert [g.output_ids for g in batch] == [g.output_ids for g in alone]
