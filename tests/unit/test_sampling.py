import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from speedkv.core.sampling import Sampler, SamplingParams, penalize_repeats
from speedkv.errors import UserError


def draws(params, logits, n=400):
    sampler = Sampler(params)
    return {sampler(logits) for _ in range(n)}


def test_greedy_takes_the_argmax():
    assert Sampler(SamplingParams())(torch.tensor([0.1, 3.0, 2.9])) == 1


def test_top_k_limits_the_candidates():
    logits = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6])
    assert draws(SamplingParams(temperature=1.0, top_k=2, seed=0), logits) == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert draws(SamplingParams(temperature=1.0, top_p=0.75, seed=0), logits) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, top_p=0.5, seed=0), logits) == {0}
    assert draws(SamplingParams(temperature=1.0, top_p=0.81, seed=0), logits) == {0, 1, 2}


def test_seed_makes_sampling_repeatable():
    logits = torch.randn(50)
    params = SamplingParams(temperature=1.5, seed=7)
    a, b = Sampler(params), Sampler(params)
    assert [a(logits) for _ in range(20)] == [b(logits) for _ in range(20)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": 0}, "max-new-tokens must be at least 1"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": -1}, "top-k"),
        ({"top_p": 0.0}, "top-p"),
        ({"top_p": 1.5}, "top-p"),
        ({"stop": ("",)}, "stop strings"),
    ],
)
def test_out_of_range_values_are_rejected(kwargs, message):
    with pytest.raises(UserError, match=message):
        SamplingParams(**kwargs).validate()


def test_extreme_values_stay_well_defined():
    logits = torch.tensor([2.0, 1.0, 0.5])
    # top_p below the likeliest token's mass still keeps that token
    assert draws(SamplingParams(temperature=1.0, top_p=1e-300, seed=0), logits) == {0}
    # a vanishing temperature is greedy rather than a division overflow
    assert Sampler(SamplingParams(temperature=1e-30))(logits) == 0


# -- transformers' rules: repetition penalty, min_new_tokens ---------------------------------
def test_repetition_penalty_follows_transformers_rule():
    logits = torch.tensor([2.0, -1.0, 0.5, -3.0, 0.0, 4.0])
    seen_ids = [0, 1, 1, 4]  # prompt and output ids, repeats allowed
    seen = torch.zeros(6, dtype=torch.bool)
    seen[seen_ids] = True
    ours = penalize_repeats(logits, seen, 2.0)
    # by hand: seen positives divided, seen negatives multiplied, the rest untouched
    assert ours.tolist() == [1.0, -2.0, 0.5, -3.0, 0.0, 4.0]
    hf = RepetitionPenaltyLogitsProcessor(penalty=2.0)(torch.tensor([seen_ids]), logits[None])
    assert torch.equal(ours, hf[0])


def test_repetition_penalty_covers_the_prompt_and_each_chosen_token():
    logits = torch.tensor([3.0, 2.9, 2.8, 0.1])
    sampler = Sampler(SamplingParams(repetition_penalty=1.2), prompt_ids=[0])
    # 0 is in the prompt (3.0 -> 2.5): 1 wins; then 1 is seen (2.9 -> 2.42): 2 wins; then 2 is
    # seen (2.8 -> 2.33) and 0 leads again: a seen token is penalised once, not per repeat
    assert [sampler(logits) for _ in range(3)] == [1, 2, 0]


def test_min_new_tokens_masks_eos_until_enough_tokens():
    logits = torch.tensor([0.0, 5.0, 1.0, 4.0])  # EOS ids 1 and 3 lead
    sampler = Sampler(SamplingParams(min_new_tokens=2), eos_ids={1, 3, 99})  # 99: no such row
    assert [sampler(logits) for _ in range(3)] == [2, 2, 1]


def test_new_rules_at_their_defaults_sample_exactly_as_before():
    logits = torch.randn(50)
    params = SamplingParams(temperature=1.5, seed=7)
    plain, informed = Sampler(params), Sampler(params, prompt_ids=[1, 2, 3], eos_ids={4})
    assert [plain(logits) for _ in range(20)] == [informed(logits) for _ in range(20)]


# -- transformers `generate` arguments ----------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, dict(temperature=0.0, top_k=0)),  # greedy, as HF's default
        ({"temperature": 0.7}, dict(temperature=0.7, top_k=0)),  # our own convention
        ({"do_sample": False, "temperature": 0.7, "top_k": 5}, dict(temperature=0.0, top_k=5)),
        ({"do_sample": True}, dict(temperature=1.0, top_k=50)),  # HF's sampling defaults
        ({"do_sample": True, "temperature": 0.5, "top_k": 0}, dict(temperature=0.5, top_k=0)),
        ({"do_sample": True, "temperature": None}, dict(temperature=1.0)),  # None = unset
        ({"stop_strings": "###"}, dict(stop=("###",))),
        ({"stop": ["a", "b"]}, dict(stop=("a", "b"))),
        (
            {"max_new_tokens": 9, "min_new_tokens": 4, "repetition_penalty": 1.3, "seed": 3},
            dict(max_new_tokens=9, min_new_tokens=4, repetition_penalty=1.3, seed=3),
        ),
        ({"top_p": 0.9, "ignore_eos": True}, dict(top_p=0.9, ignore_eos=True)),
    ],
)
def test_generate_arguments_keep_their_transformers_meaning(kwargs, expected):
    params = SamplingParams.from_generate_args(**kwargs)
    assert {key: getattr(params, key) for key in expected} == expected
    assert params.greedy == (expected.get("temperature", 0.0) == 0.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_beams": 4}, r"unknown sampling argument\(s\) num_beams; accepted: max_new_tokens"),
        ({"max_length": 20, "typical_p": 0.5}, "max_length, typical_p; accepted"),
        ({"do_sample": True, "temperature": 0.0}, "do_sample=True needs a temperature above 0"),
        ({"stop": "a", "stop_strings": "b"}, "not both"),
        ({"max_new_tokens": 4, "min_new_tokens": 5}, "min-new-tokens must be between 0 and"),
        ({"min_new_tokens": -1}, "min-new-tokens"),
        ({"repetition_penalty": 0.0}, "repetition-penalty must be above 0"),
    ],
)
def test_bad_generate_arguments_say_what_is_wrong(kwargs, message):
    with pytest.raises(UserError, match=message):
        SamplingParams.from_generate_args(**kwargs)
