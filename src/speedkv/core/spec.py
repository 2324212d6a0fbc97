"""The method spec syntax: `name:key=value,key=value`, parsed into a method's Config and
formatted back (the canonical spec). Checking a whole spec against the registry of methods,
once, is `core.registry.parse_spec` (a MethodSpec)."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

from speedkv.errors import UserError


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


def parse_config(cls: type, options: dict[str, str]) -> Any:
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
