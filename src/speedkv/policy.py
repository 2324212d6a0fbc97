"""The method interface, the registry, and the `name:key=value,...` spec syntax.

A method is a `Policy`: for one sequence it decides, layer by layer, which prompt tokens are
computed, which keys each query may see, and which K/V entries the cache keeps; the engine
carries out those decisions. Every hook has a full-attention default, so a method overrides
only what it changes. Methods register under a name and carry a dataclass `Config` whose
fields are the spec options:

    speed:lcut=22,anchors=bos        fastkv:tsp_layer=15,tsp_rate=0.2
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .compat import ModelShape
from .errors import UserError


@dataclass
class PromptInfo:
    """What a policy may know about the prompt before prefill starts."""

    ids: torch.Tensor  # [N] token ids
    header_tokens: int | None = None  # length of the chat template's generation header, if any

    @property
    def n(self) -> int:
        return int(self.ids.shape[0])


@dataclass
class Stream:
    """The residual-stream rows entering a layer during prefill (one sequence)."""

    h: torch.Tensor  # [n, hidden]
    pos: torch.Tensor  # [n] absolute positions, increasing


class Policy:
    """Full attention. Subclasses override the hooks their method changes."""

    name: ClassVar[str] = "full"

    @dataclass
    class Config:
        pass

    def __init__(self, config: Any, shape: ModelShape):
        self.config = config
        self.shape = shape

    # -- identity ------------------------------------------------------------------------------
    def spec(self) -> str:
        """Canonical spec: the name and every option with its resolved value."""
        fields = dataclasses.fields(self.config)
        if not fields:
            return self.name
        opts = ",".join(f"{f.name}={format_value(getattr(self.config, f.name))}" for f in fields)
        return f"{self.name}:{opts}"

    # -- prefill hooks -----------------------------------------------------------------------
    def begin(self, prompt: PromptInfo) -> None:
        """Called once per sequence before its prefill."""

    def computed(self, layer: int, stream: Stream) -> torch.Tensor | None:
        """Rows of `stream` that run layer `layer` (bool [n]); None means all of them.

        Rows not selected leave the residual stream for good: they are not computed in this
        layer or any later one.
        """
        return None

    def visible(self, layer: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """Extra visibility rule on top of causality: bool [n_q, n_k], True where a query
        may see a key. None means plain causal attention over what the layer holds."""
        return None

    def kept(self, layer: int, k_pos: torch.Tensor) -> torch.Tensor | None:
        """Which of the layer's prefill entries the cache keeps (bool [n] over entries in
        position order, or index [heads, m]); None keeps all of them."""
        return None

    # -- decode hooks ------------------------------------------------------------------------
    def keeps_decode_kv(self, layer: int) -> bool:
        """Whether a decode-phase token's K/V in `layer` stays in the cache for later tokens."""
        return True


# -- registry ------------------------------------------------------------------------------
_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    _REGISTRY[cls.name] = cls
    return cls


def method_names() -> list[str]:
    _load_methods()
    return sorted(_REGISTRY)


def method_class(name: str) -> type[Policy]:
    _load_methods()
    if name not in _REGISTRY:
        raise UserError(f"unknown method '{name}'; known methods: {', '.join(method_names())}")
    return _REGISTRY[name]


def _load_methods() -> None:
    from . import methods  # noqa: F401  (importing registers every method)


# -- spec syntax -----------------------------------------------------------------------------
def split_spec(spec: str) -> tuple[str, dict[str, str]]:
    """'name:key=val,key=val' -> (name, {key: val}). Values may contain ':' (anchors=sink:4)."""
    if not isinstance(spec, str) or not spec.strip():
        raise UserError("empty method spec; write e.g. 'full' or 'speed:lcut=22,anchors=bos'")
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    if not name.replace("_", "").isalnum():
        raise UserError(f"malformed method spec '{spec}': the method name must be a word")
    options: dict[str, str] = {}
    if rest.strip():
        for part in rest.split(","):
            key, eq, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or not key or not value:
                raise UserError(
                    f"malformed method spec '{spec}': options are written key=value, "
                    "separated by commas"
                )
            if key in options:
                raise UserError(f"malformed method spec '{spec}': option '{key}' given twice")
            options[key] = value
    elif rest or spec.strip().endswith(":"):
        raise UserError(f"malformed method spec '{spec}': nothing after ':'")
    return name, options


def parse_config(cls: type[Policy], options: dict[str, str]) -> Any:
    """Build a method's Config from string options, converting by the fields' types."""
    fields = {f.name: f for f in dataclasses.fields(cls.Config)}
    hints = typing.get_type_hints(cls.Config)
    kwargs: dict[str, Any] = {}
    for key, raw in options.items():
        if key not in fields:
            allowed = ", ".join(fields) or "none"
            raise UserError(f"method '{cls.name}' has no option '{key}'; its options: {allowed}")
        kwargs[key] = _convert(cls.name, key, raw, hints[key])
    return cls.Config(**kwargs)


def make_policy(spec: str, shape: ModelShape) -> Policy:
    """Parse a spec and bind it to a model: the one entry point faces and tools use."""
    name, options = split_spec(spec)
    cls = method_class(name)
    return cls(parse_config(cls, options), shape)


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _convert(method: str, key: str, raw: str, hint: Any) -> Any:
    kinds = typing.get_args(hint) if _is_union(hint) else (hint,)
    kinds = tuple(k for k in kinds if k is not type(None))
    converters: dict[Any, Callable[[str], Any]] = {bool: _to_bool, int: int, float: float, str: str}
    for kind in kinds:
        try:
            return converters[kind](raw)
        except (ValueError, KeyError):
            continue
    wanted = " or ".join(getattr(k, "__name__", str(k)) for k in kinds)
    raise UserError(f"option '{key}' of method '{method}' must be {wanted}, got '{raw}'")


def _to_bool(raw: str) -> bool:
    low = raw.lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise ValueError(raw)


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)
