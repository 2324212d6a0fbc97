"""The method registry: every method registers its Policy class under its name.

The methods live above the core (`speedkv.methods`), so the core never imports them: the
package's `__init__` imports `speedkv.methods`, which fills the registry before any code can
ask it for a method."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from speedkv.core.policy import Policy
from speedkv.core.spec import parse_config, split_spec
from speedkv.errors import UserError
from speedkv.hf.backbone import ModelShape
from speedkv.log import log

# -- registry ------------------------------------------------------------------------------
_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    _REGISTRY[cls.name] = cls
    return cls


def method_names() -> list[str]:
    return sorted(_REGISTRY)


def method_class(name: str) -> type[Policy]:
    if name not in _REGISTRY:
        raise UserError(f"unknown method '{name}'; known methods: {', '.join(method_names())}")
    return _REGISTRY[name]


# -- specs -----------------------------------------------------------------------------------
# They live here rather than in spec.py: checking a spec needs the registry, which needs spec.py.
@dataclass(frozen=True)
class MethodSpec:
    """A method spec checked as far as it can be without a model (syntax, method name, option
    names and types): parse it once, bind it to each model it runs on."""

    text: str  # as the user wrote it
    cls: type[Policy]
    options: tuple[tuple[str, str], ...] = ()  # (key, value) as written

    @property
    def name(self) -> str:
        return self.cls.name

    def __str__(self) -> str:
        return self.text

    def bind(self, shape: ModelShape) -> Policy:
        """A policy for a model of this shape, on a fresh Config (policies resolve their
        defaults into it, so no two share one)."""
        return self.cls(parse_config(self.cls, dict(self.options)), shape)


def parse_spec(text: str) -> MethodSpec:
    """Check a spec as far as it can be without a model; UserError says what is wrong."""
    name, options = split_spec(text)
    cls = method_class(name)
    parse_config(cls, options)  # unknown options and ill-typed values fail here, not at bind
    return MethodSpec(text.strip(), cls, tuple(options.items()))


def config_record(config) -> dict:
    """A run's dataclass config as JSON-ready data: method specs as the text written."""
    record = dataclasses.asdict(config)
    if "methods" in record:
        record["methods"] = [str(m) for m in config.methods]
    return record


def make_policy(spec: str | MethodSpec, shape: ModelShape, trained: str | None = None) -> Policy:
    """Parse a spec (unless it is parsed already) and bind it to a model: the one entry point
    faces and tools use. `trained` is the method the model's adapter was trained for, if it
    has one: see `fit_to_adapter`."""
    parsed = spec if isinstance(spec, MethodSpec) else parse_spec(spec)
    return fit_to_adapter(parsed, trained).bind(shape)


def fit_to_adapter(spec: MethodSpec, trained: str | None) -> MethodSpec:
    """`spec` with every option it leaves unset taken from `trained`, the method the model's
    adapter was trained for, when both name the same method. An adapter learns one layout of
    shallow and deep rows, and runs worse on any other (SPEED's deep suffix most of all), so
    a bare `speed` runs the adapter's own settings. Options the user set otherwise are kept,
    with a warning: that is an experiment, not a default."""
    if not trained:
        return spec
    trained_name, trained_options = split_spec(trained)
    if trained_name != spec.name:
        return spec  # `full` on adapted weights, say: nothing to fit
    given = dict(spec.options)
    differing = [f"{k}={v}" for k, v in given.items() if k in trained_options
                 and _canonical(spec, k, v) != _canonical(spec, k, trained_options[k])]  # fmt: skip
    if differing:
        log(f"warning: the adapter was trained for {trained}; {', '.join(differing)} runs it on a "
            "layout it never saw, which usually costs quality")  # fmt: skip
    missing = {k: v for k, v in trained_options.items() if k not in given}
    if not missing:
        return spec
    options = tuple(given.items()) + tuple(missing.items())
    text = f"{spec.name}:" + ",".join(f"{k}={v}" for k, v in options)
    return MethodSpec(text, spec.cls, options)


def _canonical(spec: MethodSpec, key: str, value: str) -> object:
    """An option's value as its Config holds it, so that `deep=1` and `deep=01` agree."""
    return getattr(parse_config(spec.cls, {key: value}), key)
