import pytest
import torch

from speedkv.core.sampling import Sampler, SamplingParams
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
