"""Every method reduces to `full` exactly at the degenerate settings it declares
(`Policy.degenerate_specs`), decodes short prompts at its defaults, and its kv_bytes are exact
for its policy. The lists come from the registry, so a new method is covered once registered."""

import math

import pytest
import torch

from speedkv.core.engine import Request
from speedkv.core.policy import Policy
from speedkv.core.registry import make_policy, method_class, method_names
from speedkv.core.sampling import SamplingParams
from speedkv.core.spec import split_spec

from conftest import EQUIVALENCE_PARAMS, random_prompt
from helpers import declared_degenerate_specs, fill_spec, greedy_with_logits

TINY_PARAMS = EQUIVALENCE_PARAMS  # the shared tiny models, Gemma 3 included

N, NEW = 80, 8


def check_declares_degenerate_specs(cls: type[Policy]) -> None:
    own = vars(cls).get("degenerate_specs")
    assert own is not None, (
        f"method '{cls.name}' ({cls.__module__}.{cls.__qualname__}) declares no degenerate "
        f'specs: add `degenerate_specs = ("{cls.name}:...",)` right after its `name = ...` '
        "line, the settings at which it must equal full attention exactly ({L} = the model's "
        "layer count, {T} = prompt + new tokens), or () if no setting does"
    )
    assert isinstance(own, tuple), f"{cls.name}.degenerate_specs must be a tuple of specs"
    foreign = [spec for spec in own if split_spec(spec)[0] != cls.name]
    assert not foreign, f"{cls.name}.degenerate_specs must name '{cls.name}', not {foreign}"


@pytest.mark.parametrize("name", method_names())
def test_every_method_declares_its_degenerate_specs(name):
    check_declares_degenerate_specs(method_class(name))


def test_a_method_without_declarations_is_told_what_to_declare():
    class Undeclared(Policy):  # inherits full's declaration, which does not describe it
        name = "undeclared"

    with pytest.raises(AssertionError, match=r"add `degenerate_specs = \(\"undeclared:"):
        check_declares_degenerate_specs(Undeclared)


DEGENERATE = [spec for name in method_names() for spec in declared_degenerate_specs(name)]


@pytest.mark.parametrize("template", DEGENERATE)
def test_degenerate_settings_reduce_to_full(tiny, tiny_engine, template):
    spec = fill_spec(template, tiny.shape.num_layers, N + NEW)
    ids = random_prompt(N, seed=3)
    full_tokens, full_logits, _ = greedy_with_logits(
        tiny_engine, ids, make_policy("full", tiny.shape), NEW
    )
    tokens, logits, _ = greedy_with_logits(tiny_engine, ids, make_policy(spec, tiny.shape), NEW)
    assert tokens == full_tokens
    assert torch.allclose(logits, full_logits, atol=1e-4, rtol=0)


def run(engine, shape, spec, n=N, new=NEW):
    policy = make_policy(spec, shape)
    sampling = SamplingParams(max_new_tokens=new, ignore_eos=True)
    return engine.generate([Request(random_prompt(n, seed=5), policy, sampling)])[0]


def per_entry(tiny):
    return tiny.shape.kv_bytes_per_token_layer(torch.float32)


@pytest.mark.parametrize(
    "spec, entries_first, entries_final",
    [
        # (prompt entries per layer x layers) at the first token and at the end; g = NEW - 1
        ("pop:lcut=3", 6 * N, 6 * (N + NEW - 1)),
        ("swiftkv:k=2", 6 * N, 6 * (N + NEW - 1)),
        (
            "swiftkv:k=2,acrosskv=2",
            (2 + 2) * N,
            (2 + 2) * (N + NEW - 1),
        ),  # 4 upper layers, 2 caches
        (
            "swiftkv:k=1,acrosskv=3",
            (1 + 2) * N,
            (1 + 2) * (N + NEW - 1),
        ),  # 5 upper layers: groups 3+2
        ("fastkv:tsp_layer=2,tsp_rate=0.5,retain=0.25,window=4", 6 * 20, 6 * (20 + NEW - 1)),
        ("fastkv:tsp_layer=2,tsp_rate=40,retain=10,window=4", 6 * 10, 6 * (10 + NEW - 1)),
        ("specprefill:keep=0.3,chunk=8", 6 * 24, 6 * (24 + NEW - 1)),  # ceil(10 chunks * 0.3) = 3
        ("specprefill:keep=0.3,chunk=8,force_last=4", 6 * 28, 6 * (28 + NEW - 1)),
        ("gemfilter:retain=0.3,filter_layer=2", 6 * 24, 6 * (24 + NEW - 1)),
        ("gemfilter:retain=17,filter_layer=2", 6 * 17, 6 * (17 + NEW - 1)),
        ("snapkv:retain=0.3,window=8,gqa=true", 6 * 24, 6 * (24 + NEW - 1)),
        ("snapkv:retain=0.3,window=8", 2 * 6 * 24, 2 * 6 * (24 + NEW - 1)),  # per query head: x2
        ("streamingllm:sink=4,window=16", 6 * 20, 6 * 20),  # a fixed cap, held during decode
        ("h2o:heavy=10,recent=6", 6 * 16, 6 * 16),
        ("h2o:heavy=0.1,recent=0.1", 6 * 16, 6 * (int(0.1 * (N + NEW - 1)) * 2)),  # grows with seen
    ],
)
def test_kv_bytes_are_exact_for_each_method(tiny, tiny_engine, spec, entries_first, entries_final):
    result = run(tiny_engine, tiny.shape, spec)
    assert result.kv_bytes == entries_first * per_entry(tiny)
    assert result.kv_bytes_final == entries_final * per_entry(tiny)


def test_pyramidinfer_bytes_follow_its_schedule(tiny, tiny_engine):
    spec = "pyramidinfer:recent=8,decay=0.5,min_context=4,sink=2"
    policy = make_policy(spec, tiny.shape)
    L, d = tiny.shape.num_layers, 0.5
    context, expected = N - 8, []
    for layer in range(L):
        if layer > 0:
            ratio = (1 - d) * (math.cos(math.pi * layer / L) + 1) / 2 + d
            keep = int(context * ratio)
            if context > 4 and 4 < keep < context:
                context = keep
        expected.append(context + 8)
    result = run(tiny_engine, tiny.shape, spec)
    assert result.layer_lengths == expected
    assert result.kv_bytes == sum(expected) * per_entry(tiny)
    assert policy.ratio(0) == 1.0 and policy.ratio(L) == pytest.approx(d)


# every method at its defaults, plus SPEED without its BoS anchor
DEFAULTS = [*method_names(), "speed:anchors=none,deep=1"]


@pytest.mark.parametrize("spec", DEFAULTS)
@pytest.mark.parametrize("n", [1, 2, 9, 40])
def test_short_prompts_generate_at_default_settings(tiny, tiny_engine, spec, n):
    # prompts no longer than a method's observation window or budget (chat-sized questions)
    # must still decode; FastKV once failed here with an empty window-score tensor
    out = run(tiny_engine, tiny.shape, spec, n=n, new=4)
    assert len(out.output_ids) == 4 and out.kv_bytes > 0
