"""Every machine's kernel paths, run on this one: the engine's float32 reference tests and the
kernel tests (each kernel against torch's, within its bounds) in a process forced onto each
alternative a CPU may take. torch's kernels only (`SPEEDKV_KERNELS=torch`); every native
kernel whatever the measured choice (`native`); oneDNN without AMX
(`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`); ATen without AVX512 (`ATEN_CPU_CAPABILITY=avx2`);
native kernels built without AMX, so prefill attention runs its AVX512-BF16 products;
native kernels built without AVX512-BF16, so prefill attention goes to torch's and the decode
linear layer runs its AVX2 products; and native kernels built with AVX2 alone (no AVX512 at
all), as on AMD before Zen 4."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speedkv.kernels import native
from speedkv.kernels.cpu import cpu_info

from helpers import compiler_targets

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["tests/unit/test_engine_equivalence.py", "tests/unit/test_decode_kernels.py",
         "tests/unit/test_prefill_kernel.py"]  # fmt: skip


PATHS = {
    "torch-kernels": {native.SWITCH: "torch"},
    "every-native-kernel": {native.SWITCH: "native"},
    "onednn-without-amx": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "aten-without-avx512": {"ATEN_CPU_CAPABILITY": "avx2"},
    "native-without-amx": {native.ARCH: "-march=native -mno-amx-tile -mno-amx-bf16"},
    "native-without-avx512-bf16": {native.ARCH: "-march=native -mno-avx512bf16"},
    "native-avx2-only": {native.ARCH: "-march=native -mno-avx512f"},
}
X86_FLAGS = ("native-without-amx", "native-without-avx512-bf16", "native-avx2-only")


@pytest.mark.parametrize("path", list(PATHS))
def test_the_reference_holds_on_every_kernel_path(path):
    if path in X86_FLAGS and not compiler_targets("__x86_64__"):
        pytest.skip("an x86 flag")
    if path == "native-without-amx" and not compiler_targets("__AMX_TILE__"):
        pytest.skip("the native kernels here are built without AMX already")
    if path == "native-avx2-only" and not compiler_targets("__AVX512F__"):
        pytest.skip("the native kernels here are built with AVX2 alone already")
    if path == "native-without-avx512-bf16" and not compiler_targets("__AVX512BF16__"):
        pytest.skip("the native kernels here are built without AVX512-BF16 already")
    # a library path this CPU takes anyway is the one the rest of the suite runs
    if path == "onednn-without-amx" and "amx_tile" not in cpu_info()[1]:
        pytest.skip("oneDNN here runs without AMX already")
    if path == "aten-without-avx512" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("ATen here runs without AVX512 already")
    env = {**os.environ, **PATHS[path]}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *TESTS]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.strip().splitlines()[-1]
