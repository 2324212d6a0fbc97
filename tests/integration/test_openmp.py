"""speedkv's OpenMP spin count: set before torch loads, never over a user's choice, and kept
from the peers the benchmarks start."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from speedkv._openmp import CHOSEN_BY_SPEEDKV, SPIN_COUNT, peer_environment

# what libgomp will read: the C library's environment, after the imports in `code`
PROBE = """
import ctypes, json, os
{code}
getenv = ctypes.CDLL(None).getenv
getenv.restype = ctypes.c_char_p
seen = getenv(b"GOMP_SPINCOUNT")
print(json.dumps([seen.decode() if seen else None, os.environ.get("{marker}")]))
"""


def spin_count_after(code: str, **settings: str) -> list[str | None]:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.pop(CHOSEN_BY_SPEEDKV, None)
    probe = PROBE.format(code=code, marker=CHOSEN_BY_SPEEDKV)
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env | settings, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_importing_speedkv_first_sets_the_spin_count_before_torch_loads():
    code = "import speedkv, sys\nassert 'torch' in sys.modules"
    assert spin_count_after(code) == [SPIN_COUNT, "1"]


@pytest.mark.parametrize(
    ("settings", "expected"),
    [({"GOMP_SPINCOUNT": "7"}, "7"), ({"OMP_WAIT_POLICY": "active"}, None)],
)
def test_a_users_own_openmp_wait_setting_is_kept(settings, expected):
    assert spin_count_after("import speedkv", **settings) == [expected, None]


def test_nothing_is_set_once_torch_has_loaded():
    # libgomp read the environment when torch loaded: a later value would mislead
    assert spin_count_after("import torch\nimport speedkv") == [None, None]


def test_peers_start_without_the_spin_count_speedkv_chose():
    chosen = {"GOMP_SPINCOUNT": SPIN_COUNT, CHOSEN_BY_SPEEDKV: "1", "PATH": "/bin"}
    assert peer_environment(chosen) == {"PATH": "/bin"}
    users = {"GOMP_SPINCOUNT": "5", "PATH": "/bin"}
    assert peer_environment(users) == users


def test_the_wait_setting_says_who_chose_it(monkeypatch):
    from speedkv._openmp import wait_setting

    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", CHOSEN_BY_SPEEDKV):
        monkeypatch.delenv(name, raising=False)
    assert wait_setting() == "libgomp's default"
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert wait_setting() == "OMP_WAIT_POLICY=passive (set before speedkv started)"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", SPIN_COUNT)
    monkeypatch.setenv(CHOSEN_BY_SPEEDKV, "1")
    assert wait_setting() == f"GOMP_SPINCOUNT={SPIN_COUNT} (speedkv's default)"
