"""Where speedkv keeps what it makes once and reuses: converted models, merged adapters, built
kernels, RULER samples."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$SPEEDKV_CACHE`, by default `~/.cache/speedkv`."""
    return Path(os.environ.get("SPEEDKV_CACHE", Path.home() / ".cache" / "speedkv"))
