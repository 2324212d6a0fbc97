"""What a measurement ran on: CPU, threads, library versions."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

# the instruction sets the kernels here (torch's, oneDNN's, speedkv's, vLLM's) choose between
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "asimd",
             "sve")  # fmt: skip


def machine_facts() -> dict:
    cpu, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and cpu == "unknown":
                cpu = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    import transformers

    return {
        "cpu": cpu,
        "isa": [f for f in ISA_FLAGS if f in flags],
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "platform": platform.platform(),
    }
