"""A batch of prompts of different lengths (and methods) gives what each gives alone."""

from speedkv.core.engine import Request
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams

from conftest import EQUIVALENCE_PARAMS, random_prompt

TINY_PARAMS = EQUIVALENCE_PARAMS  # the shared tiny models, Gemma 3 included


def requests(shape, sampling_for):
    specs = [
        "full",
        "speed:lcut=3,anchors=bos,deep=1",
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


def test_requests_join_and_leave_between_steps(tiny, tiny_engine):
    """Continuous batching: a request added mid-way decodes exactly as it would alone, and a
    cancelled one leaves with its cache."""
    from speedkv.core.engine import Batch

    def request(seed, new):
        policy = make_policy("speed:lcut=3,anchors=bos,deep=1", tiny.shape)
        return Request(
            random_prompt(30 + seed, seed=seed), policy, SamplingParams(max_new_tokens=new)
        )

    alone = {k: tiny_engine.generate([request(k, 6)])[0].output_ids for k in (1, 2, 3)}
    batch = Batch(tiny_engine)
    tokens = {k: [] for k in (1, 2, 3)}

    def take(events):
        for e in events:
            tokens[e.key].append(e.token_id)

    take(batch.add(1, request(1, 6)))
    take(batch.step())
    take(batch.add(2, request(2, 6)))
    take(batch.add(3, request(3, 6)))
    take(batch.step())
    held = batch.kv_bytes()
    batch.cancel(3)
    assert batch.kv_bytes() < held and len(batch) == 2
    while batch:
        take(batch.step())
    assert tokens[1] == alone[1] and tokens[2] == alone[2]
    assert tokens[3] == alone[3][:2]  # two tokens before it was cancelled
