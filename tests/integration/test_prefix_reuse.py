"""Reusing a cache: a prompt that extends a cached prefix prefills only its new tokens, and
what it generates equals the dense reference run with the full-depth positions that sequence
really has (one deep suffix per prefill, every generated token); full attention equals
itself from scratch; methods whose cache depends on the question refuse."""

import pytest
import torch

from speedkv.analysis.dense import speed_hidden
from speedkv.core.engine import Engine, Request
from speedkv.core.prefix import CachedPrefix, PrefixCache, common_prefix
from speedkv.core.registry import make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.errors import UserError
from speedkv.methods.speed import SpeedRule

from conftest import random_prompt

DOC, QUESTION, NEW = 41, 9, 6


def decode_by_hand(engine, done, policy, steps):
    """Greedy tokens and every logit row [steps, V] after a prefill."""
    rows, tokens = [done.logits], [int(done.logits.argmax())]
    for i in range(steps - 1):
        row = engine.decode_step([done.cache], [policy], [tokens[-1]], [done.next_position + i])[0]
        rows.append(row)
        tokens.append(int(row.argmax()))
    return tokens, torch.stack(rows)


def dense_rows(model, ids, rule, deep_positions, first_row):
    """Reference logits from position `first_row` on: anchors, the listed positions and
    everything from `first_row` (the generated tokens and the one that predicts them) are full
    depth."""
    pos = torch.arange(len(ids))
    full = (pos < rule.anchors) | (pos >= first_row)
    for p in deep_positions:
        full[p] = True
    h, kept = speed_hidden(model.backbone, torch.tensor(ids), len(ids), rule, full_depth=full)
    logits = model.backbone.logits(h)
    return logits[kept >= first_row]


@pytest.mark.parametrize(
    "spec",
    [
        "speed:lcut=3,anchors=bos,deep=1",
        "speed:lcut=3,anchors=none,deep=2",
        "speed:lcut=1,anchors=sink:4,deep=turn",
        "speed:lcut=3,anchors=bos,selfonly=true,deep=1",
    ],
)
def test_question_on_a_cached_document_equals_the_dense_reference(tiny, tiny_engine, spec):
    doc, question = random_prompt(DOC, seed=11), random_prompt(QUESTION, seed=12)
    cached = tiny_engine.prefill(doc, spec)
    policy = make_policy(spec, tiny.shape)
    done = tiny_engine.prefill_ids(
        question, policy, NEW, turn_tokens=QUESTION, base=cached.cache, start=DOC
    )
    tokens, logits = decode_by_hand(tiny_engine, done, policy, NEW)
    rule = policy.rule
    document_deep = range(DOC - rule.deep_tokens(None), DOC)  # the document's own deep suffix
    question_deep = rule.deep_tokens(None, QUESTION)
    ids = doc + question + tokens[:-1]
    reference = dense_rows(tiny, ids, rule, document_deep, DOC + QUESTION - question_deep)
    reference = reference[question_deep - 1 :]  # the rows that predict the new tokens
    assert reference.argmax(-1).tolist() == tokens
    assert torch.allclose(logits, reference, atol=1e-4, rtol=0), (logits - reference).abs().max()
    # the public call gives the same tokens, and the cached prefix is left as it was
    before = [layer.keys().clone() for layer in cached.cache.layers]
    again = tiny_engine.generate(cached, question, max_new_tokens=NEW)
    assert again.output_ids == tokens and again.reused_tokens == DOC
    assert again.prompt_ids == doc + question
    assert all(torch.equal(b, layer.keys()) for b, layer in zip(before, cached.cache.layers))


def test_full_attention_reused_equals_full_attention_from_scratch(tiny, tiny_engine):
    doc, question = random_prompt(DOC, seed=3), random_prompt(QUESTION, seed=4)
    cached = tiny_engine.prefill(doc, "full")
    reused = tiny_engine.generate(cached, question, max_new_tokens=NEW)
    scratch = tiny_engine.generate(
        [Request(doc + question, make_policy("full", tiny.shape), SamplingParams(NEW))]
    )[0]
    assert reused.output_ids == scratch.output_ids
    assert reused.kv_bytes == scratch.kv_bytes and reused.layer_lengths == scratch.layer_lengths


def test_kv_bytes_after_reuse_count_each_prefill_deep_suffix(tiny, tiny_engine):
    L, lcut = tiny.shape.num_layers, 2
    spec = f"speed:lcut={lcut},anchors=bos,deep=3"
    cached = tiny_engine.prefill(random_prompt(DOC), spec)
    result = tiny_engine.generate(cached, random_prompt(QUESTION, seed=2), max_new_tokens=NEW)
    per = tiny.shape.kv_bytes_per_token_layer(torch.float32)
    upper = 1 + 3 + 3  # BoS, the document's deep suffix, the question's
    assert result.layer_lengths == [DOC + QUESTION] * lcut + [upper] * (L - lcut)
    assert result.kv_bytes == (lcut * (DOC + QUESTION) + (L - lcut) * upper) * per


def test_multi_turn_chat_reuses_the_earlier_turn(tiny):
    """Turn two extends turn one's prompt and answer: the engine's prefix cache hands it the
    finished sequence's cache, and the result equals the dense reference in which turn one's
    fed-back answer tokens are full depth."""
    spec, lcut = "speed:lcut=3,anchors=bos,deep=1", 3
    engine = Engine(tiny, chunk_size=16, prefix_cache=PrefixCache(2**30, min_tokens=4))
    first_prompt, reply = random_prompt(DOC, seed=21), random_prompt(7, seed=22)
    sampling = SamplingParams(max_new_tokens=5)
    first = engine.generate([Request(first_prompt, make_policy(spec, tiny.shape), sampling)])[0]
    second_prompt = first_prompt + first.output_ids + reply
    policy = make_policy(spec, tiny.shape)
    second = engine.generate([Request(second_prompt, policy, SamplingParams(NEW))])[0]
    fed = len(first_prompt) + len(first.output_ids) - 1  # every first-turn token but the last
    assert second.reused_tokens == fed
    assert engine.prefix_cache.hits == 1 and engine.prefix_cache.tokens_reused == fed
    rule = SpeedRule(lcut, 1, 1)
    deep = [len(first_prompt) - 1, *range(len(first_prompt), fed)]
    ids = second_prompt + second.output_ids[:-1]
    reference = dense_rows(tiny, ids, rule, deep, len(second_prompt) - 1)
    assert reference.argmax(-1).tolist() == second.output_ids


def test_two_requests_share_one_prefix_without_touching_it(tiny, tiny_engine):
    cached = tiny_engine.prefill(random_prompt(DOC), "speed:lcut=2,anchors=bos,deep=1")
    a, b = random_prompt(QUESTION, seed=31), random_prompt(QUESTION + 3, seed=32)
    alone_a = tiny_engine.generate(cached, a, max_new_tokens=NEW).output_ids
    alone_b = tiny_engine.generate(cached, b, max_new_tokens=NEW).output_ids
    policy = make_policy(cached.method, tiny.shape)
    together = tiny_engine.generate(
        [
            Request(cached.ids + a, policy, SamplingParams(NEW), None, QUESTION, cached),
            Request(cached.ids + b, policy, SamplingParams(NEW), None, QUESTION + 3, cached),
        ]
    )
    assert [g.output_ids for g in together] == [alone_a, alone_b]


def test_methods_whose_cache_depends_on_the_question_refuse(tiny, tiny_engine):
    for spec in ("snapkv", "fastkv", "specprefill", "h2o"):
        with pytest.raises(UserError, match="cannot serve another prompt"):
            tiny_engine.prefill(random_prompt(DOC), spec)
    cached = tiny_engine.prefill(random_prompt(DOC), "full")
    snap = make_policy("snapkv", tiny.shape)
    with pytest.raises(UserError, match="cannot serve another prompt"):
        tiny_engine.generate([Request(cached.ids + [1, 2], snap, prefix=cached)])
    other = make_policy("speed:lcut=2,deep=1", tiny.shape)
    with pytest.raises(UserError, match="runs the same method"):
        tiny_engine.generate([Request(cached.ids + [1, 2], other, prefix=cached)])
    with pytest.raises(UserError, match="does not start with"):
        tiny_engine.generate(
            [
                Request(
                    [(cached.ids[0] + 1) % 101, 5], make_policy("full", tiny.shape), prefix=cached
                )
            ]
        )


def test_the_engine_prefix_cache_leaves_non_reusable_methods_alone(tiny):
    engine = Engine(tiny, chunk_size=16, prefix_cache=PrefixCache(2**30, min_tokens=4))
    ids = random_prompt(DOC)
    for _ in range(2):
        engine.generate([Request(ids, make_policy("snapkv", tiny.shape), SamplingParams(3))])
    assert len(engine.prefix_cache) == 0 and engine.prefix_cache.hits == 0


# -- the store ------------------------------------------------------------------------------
def entry(ids, method="full", nbytes=100):
    cache = type("Sized", (), {"allocated_bytes": lambda self: nbytes, "nbytes": lambda s: 0})()
    return CachedPrefix(list(ids), method, cache)


def test_prefix_cache_lookup_insert_and_lru_eviction():
    store = PrefixCache(max_bytes=250, min_tokens=2)
    store.insert(entry([1, 2, 3, 4]))
    store.insert(entry([1, 2, 3, 4, 5, 6]))  # extends the first: the first goes
    assert len(store) == 1
    store.insert(entry([1, 2]))  # covered by the longer one: nothing new kept
    assert len(store) == 1
    assert store.lookup([1, 2, 3, 9], "full")[1] == 3
    assert store.lookup([1, 2, 3, 4, 5, 6], "full")[1] == 5  # the last token is recomputed
    assert store.lookup([1, 2, 3], "speed:lcut=2,deep=1") is None  # another method's cache
    assert store.lookup([1, 7, 7], "full") is None  # one shared token is below min_tokens
    store.insert(entry([7, 7, 7]))
    store.lookup([1, 2, 3, 4], "full")  # freshens the first entry
    store.insert(entry([8, 8, 8]))  # over 250 bytes: the least recently used ([7, 7, 7]) goes
    assert store.lookup([7, 7, 7, 7], "full") is None and store.evictions == 1
    assert store.lookup([8, 8, 8, 1], "full")[1] == 3
    assert store.bytes() == 200
    assert (store.hits, store.misses) == (4, 3)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([1, 2], [1, 2]) == 2


# -- the real model, through the chat template ------------------------------------------------
REAL_SPECS = [
    "full",
    "speed:lcut=22,anchors=bos,deep=1",
    "speed:lcut=22,anchors=bos,deep=turn",
    "speed:lcut=22,anchors=none,deep=1",
    "speed:lcut=22,anchors=none,deep=turn",
]


@pytest.fixture(scope="module")
def real_doc(smol_tokenizer):
    from speedkv.prompts.haystack import haystack_text

    return haystack_text(smol_tokenizer, 300, split="calib")


def rule_of(spec, model):
    return SpeedRule.of(make_policy(spec, model.shape))


def suffix_positions(rule, end, header, turn):
    """The deep suffix a prefill ending at `end` gives under `rule`."""
    return range(end - rule.deep_tokens(header, turn), end)


def engine_rows(engine, request, prefix, reuse, steps):
    """The engine's own path by hand (copy of the cached prefix, then the new tokens): greedy
    tokens and logit rows, to hold against the dense reference."""
    policy = request.policy.fresh()
    done = engine.prefill_ids(
        request.ids[reuse:],
        policy,
        steps,
        request.header_tokens,
        request.turn_tokens,
        prefix.cache,
        reuse,
    )
    return decode_by_hand(engine, done, policy, steps)


@pytest.mark.real_model
@pytest.mark.parametrize("spec", REAL_SPECS)
def test_real_prefix_hit_equals_scratch_and_the_dense_reference(smollm2, real_doc, spec):
    """Two questions about one document: the second starts from the first's cache (the
    document turn and the next turn's role header) and equals both its from-scratch run and
    the dense reference."""
    from speedkv.hf.text import encode_messages

    engine = Engine(smollm2, prefix_cache=PrefixCache(2**31))
    tok, steps = smollm2.tokenizer, 6
    doc = {"role": "user", "content": real_doc}
    prompts = [
        encode_messages(tok, [doc, {"role": "user", "content": q}])
        for q in ("What is the passage about?", "Who wrote the passage above?")
    ]
    requests = [
        Request(
            p.ids,
            make_policy(spec, smollm2.shape),
            SamplingParams(steps),
            p.header_tokens,
            p.turn_tokens,
        )  # fmt: skip
        for p in prompts
    ]
    engine.generate([requests[0]])
    entry, reuse = engine.prefix_cache.lookup(requests[1].ids, requests[1].policy.spec())
    hit = engine.generate([requests[1]])[0]
    scratch = Engine(smollm2).generate([requests[1]])[0]
    assert hit.reused_tokens == reuse > len(prompts[0].ids) - prompts[0].turn_tokens - 8
    tokens, logits = engine_rows(engine, requests[1], entry, reuse, steps)
    assert hit.output_ids == scratch.output_ids == tokens[: len(hit.output_ids)]
    rule, p = rule_of(spec, smollm2), prompts[1]
    deep = suffix_positions(rule, len(p.ids), p.header_tokens, p.turn_tokens)
    reference = dense_rows(smollm2, p.ids + tokens[:-1], rule, deep, len(p.ids) - 1)
    assert reference.argmax(-1).tolist() == tokens
    assert torch.allclose(logits, reference, atol=1e-4, rtol=0), (logits - reference).abs().max()


@pytest.mark.real_model
@pytest.mark.parametrize("spec", REAL_SPECS)
def test_real_multi_turn_chat_equals_the_dense_reference(smollm2, real_doc, spec):
    """Turn two resends the conversation with turn one's answer: it reuses turn one's prompt
    and the answer tokens fed back, which keep their full depth."""
    from speedkv.hf.text import encode_messages

    engine = Engine(smollm2, prefix_cache=PrefixCache(2**31))
    tok, steps = smollm2.tokenizer, 6
    turn1 = [{"role": "user", "content": real_doc}, {"role": "user", "content": "Summarise it."}]
    first = encode_messages(tok, turn1)
    sampling = SamplingParams(steps)
    policy = make_policy(spec, smollm2.shape)
    answer = engine.generate(
        [Request(first.ids, policy, sampling, first.header_tokens, first.turn_tokens)]
    )[0]
    turn2 = [*turn1, {"role": "assistant", "content": answer.text},
             {"role": "user", "content": "Say it in five words."}]  # fmt: skip
    second = encode_messages(tok, turn2)
    request = Request(second.ids, policy, sampling, second.header_tokens, second.turn_tokens)
    entry, reuse = engine.prefix_cache.lookup(second.ids, policy.spec())
    fed = len(first.ids) + len(answer.output_ids) - 1
    # the re-encoded conversation extends the cached prompt and the answer tokens fed back, up
    # to where encoding the answer's text again gives other tokens (if it does)
    assert len(first.ids) < reuse <= fed
    result = engine.generate([request])[0]
    tokens, logits = engine_rows(engine, request, entry, reuse, steps)
    # the engine stops at EOS; the hand path decodes on
    assert tokens[: len(result.output_ids)] == result.output_ids
    assert result.reused_tokens == reuse
    rule = rule_of(spec, smollm2)
    deep = [
        *suffix_positions(rule, len(first.ids), first.header_tokens, first.turn_tokens),
        *range(len(first.ids), reuse),  # turn one's answer, fed back at full depth
        *suffix_positions(rule, len(second.ids), second.header_tokens, second.turn_tokens),
    ]
    reference = dense_rows(smollm2, second.ids + tokens[:-1], rule, deep, len(second.ids) - 1)
    assert reference.argmax(-1).tolist() == tokens
    assert torch.allclose(logits, reference, atol=1e-4, rtol=0), (logits - reference).abs().max()


@pytest.mark.parametrize(
    "spec",
    [
        "speed:lcut=3,anchors=bos,deep=1",
        "speed:lcut=4,anchors=first,deep=3",
        "speed:lcut=2,anchors=sink:4,deep=turn",
        "speed:lcut=0,anchors=none,deep=1",
        "speed:lcut=6,anchors=bos,deep=1",
    ],
)
def test_speed_taken_from_a_full_prefill_equals_its_own_prefill(tiny, tiny_engine, spec):
    ids = random_prompt(DOC + QUESTION, seed=21)
    policy = make_policy(spec, tiny.shape)
    sampling = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    own = tiny_engine.generate([Request(ids, policy, sampling, None, QUESTION)])[0]
    full = tiny_engine.prefill(ids, "full")
    derived = policy.prefix_from_full(full, turn_tokens=QUESTION)
    deep = policy.rule.deep_tokens(None, QUESTION)
    assert derived.ids == ids[: len(ids) - deep] and derived.method == policy.spec()
    request = Request(ids, policy, sampling, None, QUESTION, prefix=derived)
    taken = tiny_engine.generate([request])[0]
    assert taken.output_ids == own.output_ids
    assert taken.reused_tokens == len(ids) - deep
    # the same entries per layer, so the same KV bytes
    assert taken.layer_lengths == own.layer_lengths and taken.kv_bytes == own.kv_bytes
    # and the first token's logits agree to float tolerance
    kept = len(derived.ids)
    mine = tiny_engine.prefill_ids(ids, policy.fresh(), turn_tokens=QUESTION).logits
    theirs = tiny_engine.prefill_ids(
        ids[kept:], policy.fresh(), turn_tokens=QUESTION, base=derived.cache, start=kept
    ).logits
    assert torch.allclose(mine, theirs, atol=1e-4, rtol=0), (mine - theirs).abs().max()
    # the full cache it came from is left as it was
    again = tiny_engine.generate([Request(ids, make_policy("full", tiny.shape), sampling)])[0]
    assert (
        tiny_engine.generate(
            [Request(ids, make_policy("full", tiny.shape), sampling, prefix=full)]
        )[0].output_ids
        == again.output_ids
    )


def test_speed_is_taken_only_from_full_attention_and_not_for_selfonly_or_stride(tiny, tiny_engine):
    ids = random_prompt(DOC, seed=22)
    speed = tiny_engine.prefill(ids, "speed:lcut=3,anchors=bos,deep=1")
    with pytest.raises(UserError, match="full-attention"):
        make_policy("speed:lcut=2,deep=1", tiny.shape).prefix_from_full(speed)
    full = tiny_engine.prefill(ids, "full")
    with pytest.raises(UserError, match="selfonly"):
        make_policy("speed:lcut=2,selfonly=true,deep=1", tiny.shape).prefix_from_full(full)
    with pytest.raises(UserError, match="stride runs its own prefill"):
        make_policy("speed:lcut=2,deep=1,stride=8", tiny.shape).prefix_from_full(full)
