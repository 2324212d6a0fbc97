"""One stderr logger for every part of speedkv: stdout stays for results."""

from __future__ import annotations

import sys


def log(message: str, source: str = "speedkv") -> None:
    """A progress line on stderr, tagged with what speaks (stdout stays for results)."""
    print(f"[{source}] {message}", file=sys.stderr, flush=True)
