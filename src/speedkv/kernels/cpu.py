"""What this CPU offers the kernels: its instruction-set flags, and what they make fast.

`hf.loading.resolve_dtype` reads these for `auto`'s dtype; the native build and the tuner read
the switch."""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import torch

# speedkv's switch for its native kernels: "torch" turns them off, "native" uses every one
# that builds, "auto" (the default) the measured choice (kernels/tuning.py)
SWITCH = "SPEEDKV_KERNELS"


def cpu_info() -> tuple[dict[str, str], set[str]]:
    """/proc/cpuinfo's first value of each key (the first CPU's), and its ISA flags (x86's
    `flags`, arm64's `Features`); empty where there is none."""
    facts: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            facts.setdefault(key, value)
    except OSError:
        pass
    return facts, set((facts.get("flags") or facts.get("Features") or "").split())


def _cpu_flags() -> set[str]:
    return cpu_info()[1]


def cpu_has_bf16_matmul() -> bool:
    """AMX or AVX512-BF16: the CPU instructions that make bf16 matmuls faster than float32."""
    return bool({"amx_bf16", "avx512_bf16"} & _cpu_flags())


def cpu_decodes_bf16_natively() -> bool:
    """An x86 CPU with AVX2 and FMA where speedkv's decode kernel can be built (a C++
    compiler, native kernels not switched off). There bfloat16 weights decode 3x faster than
    float32 ones (speedkv's kernel reads half the bytes) while a prefill's products run in
    float32 either way, so `auto` loads bfloat16 (docs/engine.md); on torch's kernels alone
    bfloat16 would decode slower than float32."""
    if os.environ.get(SWITCH, "auto").lower() == "torch":
        return False
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    return compiler is not None and {"avx2", "fma"} <= _cpu_flags()


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN takes bfloat16 weights here: it needs AVX512BW/VL/DQ or AVX-NE-CONVERT,
    and raises on a CPU without them (AVX2-only x86) where torch's own kernels still work."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
