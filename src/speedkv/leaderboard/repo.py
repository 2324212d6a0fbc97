"""Where a leaderboard runs: the repository that holds its boards, the kvpress peer script and
the adapters, and this environment's `speedkv`."""

from __future__ import annotations

import sys
from pathlib import Path


def _root() -> Path:
    """The checkout this package is installed from (an editable install), else the current
    directory: the boards, benchmarks/kvpress_peer.py and the adapters live in a checkout."""
    checkout = Path(__file__).resolve().parents[3]
    return checkout if (checkout / "benchmarks" / "kvpress_peer.py").is_file() else Path.cwd()


ROOT = _root()
BOARDS = ROOT / "benchmarks" / "ruler"  # one folder per board: MODEL-LENGTH
# kvpress's half runs in its own environment, so it is a script run by path, never imported
KVPRESS_PEER = ROOT / "benchmarks" / "kvpress_peer.py"
SPEEDKV = str(Path(sys.executable).with_name("speedkv"))  # this environment's CLI
