"""What a measurement ran on: CPU, the instruction sets that matter, cores, memory, library
versions, and the kernel chosen for each kind of work."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import torch

from speedkv._openmp import wait_setting
from speedkv.kernels.cpu import cpu_info

# the instruction sets the kernels here (torch's, oneDNN's, speedkv's, vLLM's) choose between
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile",
             "asimd", "sve", "bf16", "i8mm")  # fmt: skip


def machine_facts() -> dict:
    facts, flags = cpu_info()
    cpu = facts.get("model name") or platform.processor() or "unknown"
    vendor = facts.get("vendor_id") or facts.get("CPU implementer") or "unknown"
    memory_kib = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_kib = int(line.split()[1])
    except OSError:
        pass
    import transformers

    onednn = re.search(r"(?:oneDNN|MKL-DNN) v([\d.]+)", torch.__config__.show())
    return {
        "cpu": cpu,
        "vendor": vendor,
        "isa": [f for f in ISA_FLAGS if f in flags],
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(memory_kib / 2**20, 1),
        "threads": torch.get_num_threads(),
        "openmp_wait": wait_setting(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn": onednn[1] if onednn else None,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "kernels": kernel_facts(),
    }


def machine_label() -> str:
    """One line that tells this CPU from the others a long sweep may run on: its model, family
    and model numbers (AMD's names repeat across generations) and the ISA flags that matter."""
    facts, flags = cpu_info()
    name = facts.get("model name") or platform.processor() or platform.machine() or "unknown"
    ids = ", ".join(f"{k} {facts[k]}" for k in ("cpu family", "model", "CPU part") if k in facts)
    isa = " ".join(f for f in ISA_FLAGS if f in flags) or "no listed ISA flags"
    return f"{name} ({ids}; {isa})" if ids else f"{name} ({isa})"


def kernel_facts() -> dict:
    """The compiler the native kernels build with, whether each is built, and the kernel
    chosen for each kind of work here (measured once per machine: kernels/tuning.py)."""
    from speedkv.kernels import native, tuning

    choice = tuning.kernel_choice()  # first, as it builds what this machine has not yet
    try:
        compiler = native.compiler_target()[0]
        built = native.kernel_status()
    except native.KernelUnavailable as why:
        compiler, built = f"unavailable ({why})", {}
    return {"compiler": compiler, "built": built, "mode": tuning.mode(),
            "choice": choice.lines(), "timings_ms": choice.timings}  # fmt: skip
