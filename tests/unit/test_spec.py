import pytest

from speedkv.core.registry import make_policy, method_names
from speedkv.core.spec import split_spec
from speedkv.errors import UserError
from speedkv.hf.backbone import ModelShape

from helpers import declared_degenerate_specs, fill_spec

SHAPE = ModelShape("llama", 30, 576, 9, 3, 64, 1536, 49152, 8192)


def test_split_spec_keeps_colons_inside_values():
    assert split_spec("speed:lcut=22,anchors=sink:4") == (
        "speed",
        {"lcut": "22", "anchors": "sink:4"},
    )
    assert split_spec(" full ") == ("full", {})


def test_canonical_spec_lists_every_resolved_option():
    assert make_policy("full", SHAPE).spec() == "full"
    # the default deep suffix is 64 tokens (DEFAULT_DEEP); the paper's is deep=1
    assert make_policy("speed", SHAPE).spec() == "speed:lcut=22,anchors=bos,deep=64,selfonly=false"
    spec = "speed:selfonly=true,deep=header,anchors=sink:4,lcut=0"
    assert (
        make_policy(spec, SHAPE).spec() == "speed:lcut=0,anchors=sink:4,deep=header,selfonly=true"
    )
    # the canonical form parses back to itself
    canon = make_policy("speed:lcut=26", SHAPE).spec()
    assert make_policy(canon, SHAPE).spec() == canon
    # stride is named only when set, so plain SPEED's spec stays what records name
    strided = make_policy("speed:lcut=22,deep=1,stride=40", SHAPE).spec()
    assert strided == "speed:lcut=22,anchors=bos,deep=1,selfonly=false,stride=40"
    assert make_policy(strided, SHAPE).spec() == strided
    assert make_policy("speed:lcut=22,stride=0", SHAPE).spec().endswith("selfonly=false")


@pytest.mark.parametrize("name", method_names())
def test_canonical_spec_parses_back_to_itself_for_every_method(name):
    # the default, and every declared degenerate setting (which equal full only while the
    # canonical form keeps them as they are)
    templates = (name, *declared_degenerate_specs(name))
    for spec in (fill_spec(t, SHAPE.num_layers, 88) for t in templates):
        canon = make_policy(spec, SHAPE).spec()
        assert canon.split(":")[0] == name
        assert make_policy(canon, SHAPE).spec() == canon, spec


def test_registry_knows_full_and_speed():
    assert {"full", "speed"} <= set(method_names())


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "empty method spec"),
        ("speed:", "nothing after"),
        ("speed:lcut", "key=value"),
        ("speed:lcut=1,lcut=2", "given twice"),
        ("sp eed", "must be a word"),
        ("nosuch", "unknown method 'nosuch'"),
        ("speed:cut=3", "has no option 'cut'"),
        ("speed:lcut=abc", "must be int"),
        ("speed:lcut=31", "lcut must be between 0 and 30"),
        ("speed:lcut=-1", "lcut must be between 0 and 30"),
        ("speed:anchors=sink:0", "anchors must be"),
        ("speed:anchors=eos", "anchors must be"),
        ("speed:deep=0", "deep must be"),
        ("speed:deep=tail", "deep must be"),
        ("speed:selfonly=maybe", "must be bool"),
        ("speed:stride=1", "stride must be 0"),
        ("speed:stride=-3", "stride must be 0"),
        ("full:lcut=3", "has no option 'lcut'"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(UserError, match=message):
        make_policy(spec, SHAPE)


TRAINED = "speed:lcut=22,anchors=bos,deep=1,selfonly=false"  # as an adapter's training.json has it


def test_an_adapter_fills_the_options_a_spec_leaves_unset(capsys):
    # a bare `speed` on an adapter trained with deep=1 runs deep=1, not the default 64
    assert make_policy("speed", SHAPE, TRAINED).spec() == TRAINED
    assert make_policy("speed:lcut=22", SHAPE, TRAINED).spec() == TRAINED
    assert capsys.readouterr().err == ""  # nothing set against the adapter: no warning
    # without an adapter, or for another method, the defaults stand
    assert make_policy("speed", SHAPE).spec().endswith("deep=64,selfonly=false")
    assert make_policy("full", SHAPE, TRAINED).spec() == "full"
    assert (
        make_policy("pop:lcut=22", SHAPE, TRAINED).spec()
        == make_policy("pop:lcut=22", SHAPE).spec()
    )


def test_an_option_set_against_the_adapter_is_kept_with_a_warning(capsys):
    policy = make_policy("speed:deep=64,lcut=22", SHAPE, TRAINED)
    assert policy.spec() == "speed:lcut=22,anchors=bos,deep=64,selfonly=false"
    err = capsys.readouterr().err
    assert f"trained for {TRAINED}" in err and "deep=64" in err and "lcut" not in err.split(";")[1]


def test_an_engine_on_adapted_weights_runs_the_adapters_own_settings():
    import dataclasses

    from speedkv.core.engine import Engine

    from conftest import tiny_model

    base = tiny_model("llama")
    layers = base.shape.num_layers
    trained = f"speed:lcut={layers - 1},anchors=bos,deep=1,selfonly=false"
    adapted = dataclasses.replace(base, trained_method=trained)
    assert Engine(adapted).policy("speed").spec() == trained
    assert Engine(base).policy("speed").spec() != trained  # the defaults, without an adapter
    # what runs is what the spec says: the adapted engine's bare `speed` is its trained spec
    from speedkv.core.engine import Request
    from speedkv.core.sampling import SamplingParams

    engine = Engine(adapted)

    def tokens(method: str) -> list[int]:
        request = Request(list(range(3, 40)), engine.policy(method), SamplingParams(4))
        return engine.generate([request])[0].output_ids

    assert tokens("speed") == tokens(trained) != tokens(f"speed:lcut={layers - 1},deep=5")
