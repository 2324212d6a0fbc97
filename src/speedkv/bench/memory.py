"""Peak resident memory of this process, resettable so each measurement has its own peak."""

from __future__ import annotations

import contextlib
import re
import resource
import sys
from pathlib import Path

_STATUS = Path("/proc/self/status")


def reset_peak_rss() -> None:
    """Start a new peak (Linux: writing 5 to clear_refs resets VmHWM); elsewhere a no-op."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int:
    """Peak resident set size since the last reset (or since start where resets are unsupported)."""
    try:
        match = re.search(r"VmHWM:\s+(\d+) kB", _STATUS.read_text())
        if match:
            return int(match.group(1)) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
