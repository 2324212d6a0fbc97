"""How long torch's OpenMP threads spin before they sleep: speedkv's default, set before torch
loads.

libgomp, torch's OpenMP runtime, keeps a thread that waits at a barrier spinning for 300,000
`pause` instructions (milliseconds on an Intel Xeon) before it sleeps. On a quiet machine that
only saves wake-ups. On one where other processes keep the cores busy, the spinning thread holds
the core its descheduled partner needs, and every parallel region waits out a scheduler time
slice: decode ran 30x slower there (docs/engine.md, "On a busy machine, spin less"). With 1000
spins it ran as fast as with one thread, and on a quiet machine as fast as with the default.

libgomp reads the variable once, when torch loads it. So this module sets it when imported,
and `speedkv/__init__` imports it before anything that loads torch; after that, setting it
would change nothing. A user's own GOMP_SPINCOUNT or OMP_WAIT_POLICY is left as it is.
Benchmarks that start a peer (vLLM, llama.cpp, kvpress, ...) give it `peer_environment()`, so
a peer runs with its own defaults, not speedkv's.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

SPIN_COUNT = "1000"
# set beside GOMP_SPINCOUNT when speedkv chose it, so peers can be started without it
CHOSEN_BY_SPEEDKV = "SPEEDKV_CHOSE_GOMP_SPINCOUNT"
_USER_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def spin_less_by_default() -> bool:
    """Set GOMP_SPINCOUNT to speedkv's default, unless the user set how OpenMP waits or torch is
    already loaded (its libgomp has read the environment then). Returns whether it was set."""
    if "torch" in sys.modules or any(name in os.environ for name in _USER_SETTINGS):
        return False
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    os.environ[CHOSEN_BY_SPEEDKV] = "1"
    return True


def peer_environment(environment: Mapping[str, str] | None = None) -> dict[str, str]:
    """`environment` (default: this process's) without the spin count speedkv chose for
    itself: what another engine is started with, so it runs on its own defaults."""
    env = dict(os.environ if environment is None else environment)
    if env.pop(CHOSEN_BY_SPEEDKV, None) is not None:
        env.pop("GOMP_SPINCOUNT", None)
    return env


def wait_setting() -> str:
    """How this process's OpenMP threads wait, and who chose it (for `doctor` and results)."""
    chosen = [f"{name}={os.environ[name]}" for name in _USER_SETTINGS if name in os.environ]
    if os.environ.get(CHOSEN_BY_SPEEDKV):
        return f"{', '.join(chosen)} (speedkv's default)"
    return f"{', '.join(chosen)} (set before speedkv started)" if chosen else "libgomp's default"


spin_less_by_default()
