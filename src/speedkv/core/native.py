"""The engine's own C++ kernels (csrc/), compiled for this machine on first use.

torch.utils.cpp_extension builds them with the system's C++ compiler and ninja into
`$SPEEDKV_CACHE/kernels/` once (about half a minute); later processes load the built library
in well under a second. The build is keyed by the source, torch's version and the CPU's
instruction sets, since it is compiled with `-march=native`.

Without a compiler, or with `SPEEDKV_KERNELS=torch`, the engine keeps torch's own kernels:
the same results within rounding, slower. CUDA tensors always take torch's kernels. The
bfloat16 prefill kernel exists only where the CPU has AVX512-BF16 (`has_prefill_kernel`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import warnings
from pathlib import Path

import torch

from speedkv.hf.loading import cache_dir
from speedkv.log import log

KERNELS = ("decode_attention.cpp", "decode_linear.cpp", "layer_ops.cpp", "prefill_attention.cpp")
HEADERS = ("bf16_pairs.h",)
SOURCES = [Path(__file__).parent / "csrc" / name for name in KERNELS]
SWITCH = "SPEEDKV_KERNELS"  # "torch" turns the native kernels off
FLAGS = ["-O3", "-march=native", "-fopenmp"]


def native_enabled() -> bool:
    """Whether the native kernels are wanted (they may still fail to build)."""
    return os.environ.get(SWITCH, "native").lower() != "torch"


@functools.cache
def native_ops():
    """torch.ops.speedkv with the native kernels registered, or None when they are switched
    off or cannot be built here (the reason is warned about once)."""
    if not native_enabled():
        return None
    try:
        _compile(cache_dir() / "kernels" / _build_key())
    except Exception as error:  # noqa: BLE001 - any build failure means: use torch's kernels
        warnings.warn(
            f"speedkv's native CPU kernels could not be built ({type(error).__name__}: "
            f"{str(error).strip().splitlines()[-1] if str(error).strip() else error!r}); "
            f"using torch's kernels. Set {SWITCH}=torch to skip the attempt.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return torch.ops.speedkv


def has_prefill_kernel(ops) -> bool:
    """Whether `ops` (from `native_ops`) has the bfloat16 prefill kernel: it is compiled only
    for CPUs with the AVX512-BF16 instructions."""
    return ops is not None and hasattr(ops, "causal_attention")


def has_linear_kernel(ops) -> bool:
    """Whether `ops` has the bfloat16 decode linear kernel (AVX512-BF16 CPUs only)."""
    return ops is not None and hasattr(ops, "packed_linear")


def _compile(build: Path) -> None:
    """Build the library into `build` unless it is there, and load it. torch's builder holds
    a lock in the directory, so processes starting together build it once; when it is built,
    this only loads it (about 30 ms)."""
    from torch.utils.cpp_extension import load

    if not (build / "speedkv_kernels.so").is_file():
        build.mkdir(parents=True, exist_ok=True)
        log(f"compiling speedkv's CPU kernels into {build} (once for this machine)")
    with _ninja_on_path():
        load(
            name="speedkv_kernels",
            sources=[str(s) for s in SOURCES],
            build_directory=str(build),
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],  # resolves to the libgomp torch already loaded
            is_python_module=False,
            verbose=False,
        )


@contextlib.contextmanager
def _ninja_on_path():
    """torch's builder calls `ninja` by name; the pip package puts it in its own directory,
    which is not on PATH unless the environment is activated."""
    try:
        import ninja
    except ImportError:
        yield
        return
    saved = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, saved])
    try:
        yield
    finally:
        os.environ["PATH"] = saved


def _build_key() -> str:
    digest = hashlib.sha256()
    for source in [*SOURCES, *(Path(__file__).parent / "csrc" / h for h in HEADERS)]:
        digest.update(source.read_bytes())
    digest.update(" ".join(FLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(platform.machine().encode())
    digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
