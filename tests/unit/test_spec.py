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
        ("full:lcut=3", "has no option 'lcut'"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(UserError, match=message):
        make_policy(spec, SHAPE)
