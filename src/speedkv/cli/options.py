"""Option types every command shares."""

from __future__ import annotations

from speedkv.errors import UserError


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise UserError(f"lengths must be comma-separated token counts, got '{text}'") from err
    if not lengths or any(n < 16 for n in lengths):
        raise UserError(f"lengths must be token counts of at least 16, got '{text}'")
    return lengths


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(";") if m.strip()]
    if not methods:
        raise UserError("give at least one method, e.g. --methods 'full;speed:lcut=22,anchors=bos'")
    return methods
