"""One home for each rule: the SPEED rule object, the softmax scoring helper, the
score-then-keep choice, fresh per-sequence policies, companion models, and the prompt
builders, each checked on hand cases."""

import random

import pytest
import torch

from speedkv.core.engine import Engine
from speedkv.core.policy import PromptInfo, Stream
from speedkv.core.registry import make_policy, method_names
from speedkv.errors import UserError
from speedkv.methods.probe import QueryRecorder
from speedkv.methods.retention import keep_mask
from speedkv.methods.scoring import attention_probs, attention_received
from speedkv.methods.speed import SpeedRule

from conftest import random_prompt


# -- the SPEED rule ---------------------------------------------------------------------------
def test_full_depth_positions_are_anchors_deep_suffix_and_generated():
    rule = SpeedRule(lcut=2, anchors=2, deep=3)
    pos = torch.arange(12)
    got = rule.full_depth(pos, prompt_len=9, deep=rule.deep_tokens(None))
    assert got.nonzero()[:, 0].tolist() == [0, 1, 6, 7, 8, 9, 10, 11]
    assert SpeedRule(2, deep="header").deep_tokens(5) == 5
    assert SpeedRule(2, deep="header").deep_tokens(None) == 1


def test_visibility_is_causal_and_selfonly_only_above_the_cutoff():
    pos = torch.tensor([0, 5, 6, 7])  # an anchor, then deep tokens
    plain = SpeedRule(lcut=1, anchors=1)
    causal = pos[None, :] <= pos[:, None]
    assert torch.equal(plain.visibility(3, pos, pos), causal)
    selfonly = SpeedRule(lcut=1, anchors=1, selfonly=True)
    assert torch.equal(selfonly.visibility(0, pos, pos), causal)  # lower layers: no change
    expected = torch.tensor(
        [
            [True, False, False, False],  # the anchor sees itself
            [True, True, False, False],  # a deep token: the anchor and itself
            [True, False, True, False],
            [True, False, False, True],
        ]
    )
    assert torch.equal(selfonly.upper_visibility(pos, pos), expected)


def test_rules_of_policies(tiny):
    L = tiny.shape.num_layers
    assert SpeedRule.of(make_policy("full", tiny.shape)) == SpeedRule.full(L)
    assert SpeedRule.full(L) == SpeedRule(L, anchors=0, selfonly=False)
    speed = make_policy("speed:lcut=2,anchors=sink:3,deep=header,selfonly=true", tiny.shape)
    assert SpeedRule.of(speed) == SpeedRule(2, 3, "header", True)
    assert SpeedRule.of(speed).at(4) == SpeedRule(4, 3, "header", True)
    with pytest.raises(UserError, match="has no SPEED rule"):
        SpeedRule.of(make_policy("pop:lcut=3", tiny.shape))
    for bad in (0, "tail"):
        with pytest.raises(UserError, match="deep must be a token count"):
            SpeedRule(2, deep=bad)


def test_the_speed_policy_follows_its_rule(tiny):
    policy = make_policy("speed:lcut=2,anchors=sink:2,deep=3,selfonly=true", tiny.shape)
    policy.begin(PromptInfo(torch.zeros(10, dtype=torch.long)))
    pos = torch.arange(10)
    stream = Stream(torch.zeros(10, 4), pos)
    assert policy.computed(1, stream) is None
    assert torch.equal(policy.computed(2, stream), policy.rule.full_depth(pos, 10, 3))
    q = torch.tensor([7, 8])
    assert policy.visible(1, q, pos) is None
    assert torch.equal(policy.visible(2, q, pos), policy.rule.upper_visibility(q, pos))


# -- softmax scoring ----------------------------------------------------------------------------
def test_attention_probs_without_positions_see_every_key():
    torch.manual_seed(0)
    q, k = torch.randn(4, 3, 8), torch.randn(2, 5, 8)  # two query heads per KV head
    expected = torch.softmax(q @ k.repeat_interleave(2, 0).transpose(1, 2) / 8**0.5, -1)
    assert torch.allclose(attention_probs(q, None, k, None), expected, atol=1e-6)
    # with positions after every key, the causal mask changes nothing
    late = attention_probs(q, torch.tensor([10, 11, 12]), k, torch.arange(5))
    assert torch.allclose(late, expected, atol=1e-6)


def test_attention_received_sums_probs_over_queries_chunk_by_chunk():
    torch.manual_seed(1)
    q, k = torch.randn(2, 7, 4), torch.randn(1, 7, 4)
    pos = torch.arange(7)
    whole = attention_probs(q, pos, k, pos).sum(1)
    assert torch.allclose(attention_received(q, pos, k, pos, chunk=3), whole, atol=1e-6)


def test_keep_mask_keeps_the_best_prefix_entries_and_the_tail():
    scores = torch.tensor([0.1, 0.9, 0.2, 0.8, 0.3])  # entries 0..4 precede a tail 5..6
    assert keep_mask(scores, 4, 7).nonzero()[:, 0].tolist() == [1, 3, 5, 6]
    assert keep_mask(scores, 9, 7).all()


# -- one policy instance per sequence -----------------------------------------------------------
@pytest.mark.parametrize("name", method_names())
def test_fresh_policies_share_the_resolved_config_not_the_state(tiny, name):
    policy = make_policy(name, tiny.shape)
    policy.marker = "per-sequence state"
    fresh = policy.fresh()
    assert type(fresh) is type(policy) and fresh is not policy
    assert fresh.spec() == policy.spec() and fresh.config is not policy.config
    assert not hasattr(fresh, "marker")


def test_the_query_recorder_is_fresh_with_its_layers(tiny):
    recorder = QueryRecorder(tiny.shape, {1, 3})
    recorder.prompt_keys[1] = torch.zeros(1)
    fresh = recorder.fresh()
    assert fresh.layers == {1, 3} and fresh.prompt_keys == {}


def test_each_sequence_of_a_batch_runs_its_own_policy(tiny, tiny_engine):
    from speedkv.core.engine import Request
    from speedkv.core.sampling import SamplingParams

    policy = make_policy("h2o:heavy=4,recent=4", tiny.shape)
    requests = [
        Request(random_prompt(n, seed=n), policy, SamplingParams(max_new_tokens=4))
        for n in (20, 33)
    ]
    together = tiny_engine.generate(requests)
    alone = [tiny_engine.generate([r])[0] for r in requests]
    assert [g.output_ids for g in together] == [g.output_ids for g in alone]
    assert policy.scores == {}  # the shared instance never ran a sequence itself


# -- companion models ---------------------------------------------------------------------------
def test_companion_models_load_once_per_engine(tiny, monkeypatch):
    loads = []

    def fake_load(name, **kwargs):
        loads.append((name, kwargs["dtype"]))
        return tiny

    monkeypatch.setattr("speedkv.hf.loading.load_model", fake_load)
    engine = Engine(tiny)
    first = engine.companion("some-speculator")
    assert engine.companion("some-speculator") is first
    assert loads == [("some-speculator", tiny.backbone.dtype)]
    Engine(tiny).companion("some-speculator")  # another engine holds its own
    assert len(loads) == 2


def test_only_other_speculators_are_external_models(tiny):
    assert make_policy("specprefill", tiny.shape).external_models() == []
    assert make_policy("specprefill:speculator=self:2", tiny.shape).external_models() == []
    other = make_policy("specprefill:speculator=/models/small", tiny.shape)
    assert other.external_models() == ["/models/small"]
    assert all(make_policy(n, tiny.shape).external_models() == [] for n in ("full", "speed"))


# -- prompt builders ----------------------------------------------------------------------------
def test_raw_passages_have_the_exact_length(smol_tokenizer):
    from speedkv.prompts.builders import raw_passage
    from speedkv.prompts.haystack import haystack_text

    ids = raw_passage(smol_tokenizer, 120, "calib", start=7)
    assert len(ids) == 120
    text = haystack_text(smol_tokenizer, 184, split="calib", start=7)
    assert ids == smol_tokenizer(text)["input_ids"][:120]


def test_text_source_passages_equal_haystack_text_at_the_same_start(smol_tokenizer):
    from speedkv.prompts.builders import TextSource
    from speedkv.prompts.haystack import haystack_text

    source = TextSource(smol_tokenizer, split="calib")
    start = random.Random(4).randrange(len(source.pool))
    text = source.text(random.Random(4), 150)
    assert text == haystack_text(smol_tokenizer, 150, split="calib", start=start)


def test_taking_more_sentences_than_the_pool_holds_is_an_error():
    from speedkv.prompts.haystack import take_sentences

    pool = ["One.", "Two.", "Three."]
    assert take_sentences(pool, 2, 2, lambda at: 1) == "Three. One."
    with pytest.raises(UserError, match="hold only about 3 tokens"):
        take_sentences(pool, 10, 0, lambda at: 1)
    # a long haystack may read the pool again
    assert take_sentences(pool, 7, 1, lambda at: 1, repeat=True) == (
        "Two. Three. One. Two. Three. One. Two."
    )


def test_chat_prompts_of_exact_length_and_about_a_passage(smol_tokenizer):
    from speedkv.hf.text import encode_prompt
    from speedkv.prompts.builders import exact_chat_prompt, passage_prompt

    ids = exact_chat_prompt(smol_tokenizer, 90)
    assert len(ids) == 90 and ids[0] == smol_tokenizer.bos_token_id
    with pytest.raises(UserError, match="too short for the chat template"):
        exact_chat_prompt(smol_tokenizer, 3)
    asked = passage_prompt(smol_tokenizer, "Some text.", "Summarise it.")
    assert asked == encode_prompt(smol_tokenizer, "Some text.\n\nSummarise it.").ids


def test_exact_prompts_on_a_model_without_a_chat_template(smol_tokenizer):
    """A base model's prompt is raw text with its tokenizer's own special tokens (none for
    SmolLM2's; Gemma 3's `<bos>`: tests/integration/test_real_gemma3.py), still exactly long."""
    import copy

    from speedkv.prompts.builders import exact_chat_prompt

    base = copy.deepcopy(smol_tokenizer)
    base.chat_template = None
    ids = exact_chat_prompt(base, 90)
    assert len(ids) == 90 and smol_tokenizer.bos_token_id not in ids
    assert base.decode(ids) == base.decode(base(base.decode(ids))["input_ids"])
