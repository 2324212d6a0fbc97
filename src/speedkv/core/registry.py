"""The method registry: every method registers its Policy class under its name.

The methods live above the core (`speedkv.methods`), so the core never imports them: the
package's `__init__` imports `speedkv.methods`, which fills the registry before any code can
ask it for a method."""

from __future__ import annotations

from speedkv.core.policy import Policy
from speedkv.core.spec import parse_config, split_spec
from speedkv.errors import UserError
from speedkv.hf.backbone import ModelShape

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


def make_policy(spec: str, shape: ModelShape) -> Policy:
    """Parse a spec and bind it to a model: the one entry point faces and tools use."""
    name, options = split_spec(spec)
    cls = method_class(name)
    return cls(parse_config(cls, options), shape)
