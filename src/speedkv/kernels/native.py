"""The engine's own C++ kernels (csrc/), compiled for this machine on first use.

torch.utils.cpp_extension builds each kernel source with the system's C++ compiler and ninja
into its own library under `$SPEEDKV_CACHE/kernels/<machine>/<kernel>-<source>/`, once, on as
many cores as the process may use (`build_missing`: all six took 67 s on 2 cores of an Intel
Xeon, against 98 s one after another); later processes load the built libraries in
milliseconds.

- **The key.** Libraries are compiled with `-march=native`, so the machine part of the path
  comes from what the compiler itself says it will target here (its predefined instruction-set
  macros) and its version, with torch's version: a cache shared between machines never hands
  one a library built for another's instructions.
- **One kernel, one library.** A kernel that fails to compile is recorded as failed in its own
  directory (not retried by every process) and reported once; the others are used.
- **A lock a dead process cannot hold.** Builders take an exclusive `flock` on the kernel's
  directory, which the system releases when its holder dies; a stale lock file left by
  torch's own builder (a build killed halfway) is removed under it. A process that waits longer
  than `SPEEDKV_KERNEL_LOCK_TIMEOUT` seconds (600) for another's build uses torch's kernels.

Without a compiler, or with `SPEEDKV_KERNELS=torch`, the engine keeps torch's own kernels:
the same results within rounding, slower. Where both exist, which one runs each kind of work
is chosen by measuring them on this machine (`kernels/tuning.py`). CUDA tensors always take
torch's kernels. The bfloat16 prefill attention kernel exists only where the CPU has
AVX512-BF16, the decode linear kernel where it has AVX512-BF16 or AVX2 and FMA: elsewhere
their libraries build without them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from speedkv.kernels.catalogue import CATALOGUE
from speedkv.kernels.cpu import SWITCH
from speedkv.locks import exclusive
from speedkv.log import log
from speedkv.paths import cache_dir

CSRC = Path(__file__).parent / "csrc"
# each source, and the operators it may register in torch.ops.speedkv (kernels/catalogue.py)
KERNELS = {kernel.name: kernel.operators for kernel in CATALOGUE}
HEADERS = ("bf16_pairs.h", "amx_tiles.h")
LOCK_TIMEOUT = "SPEEDKV_KERNEL_LOCK_TIMEOUT"
BUILD_JOBS = "SPEEDKV_KERNEL_BUILD_JOBS"  # builders at once on a first start; 1 builds in-process
ARCH = "SPEEDKV_KERNEL_ARCH"  # the target flags, "-march=native" unless set (tests set others)


def flags() -> list[str]:
    """The compiler flags every kernel is built with."""
    return ["-O3", *os.environ.get(ARCH, "-march=native").split(), "-fopenmp"]


# the compiler macros that say which instructions -march=native may use
ISA_MACRO = re.compile(r"#define (__(?:AVX|AMX|SSE|FMA|F16C|BMI|ARM_FEATURE|ARM_NEON|ARM_ARCH"
                       r"|aarch64|x86_64|SVE|riscv)\w*) ?(.*)")  # fmt: skip


class NativeKernels:
    """The native operators this process loaded, as attributes (a kernel whose library is
    unavailable here has none: test with `hasattr`)."""

    def __init__(self, operators: dict[str, Callable]):
        self.__dict__.update(operators)
        self.names = tuple(sorted(operators))

    def __repr__(self) -> str:
        return f"NativeKernels({', '.join(self.names)})"


class KernelUnavailable(RuntimeError):
    """A kernel that cannot be used here, and why."""


def native_enabled() -> bool:
    """Whether the native kernels are wanted (they may still fail to build)."""
    return os.environ.get(SWITCH, "native").lower() != "torch"


@functools.cache
def native_ops() -> NativeKernels | None:
    """Every native kernel that could be built (or was) for this machine, or None when they
    are switched off or none could be; each one that could not is reported once. Which of
    them the engine uses for each kind of work is `kernels.tuning`'s choice."""
    if not native_enabled():
        return None
    try:
        root = kernels_root()
    except KernelUnavailable as why:
        _report("every kernel", why)
        return None
    build_missing(root)
    operators = {}
    for name in KERNELS:
        try:
            load_kernel(root, name)
        except KernelUnavailable as why:
            _report(name, why)
            continue
        for op in KERNELS[name]:
            if hasattr(torch.ops.speedkv, op):  # bf16 kernels register nothing without bf16
                operators[op] = getattr(torch.ops.speedkv, op)
    return NativeKernels(operators) if operators else None


# A builder process: builds the kernels named, in that order, skipping any another builder holds
# (its lock is tried without waiting) and coming back to it, until each is built or recorded as
# failed (load_kernel records failures itself).
BUILDER = """
import os, sys, time
from pathlib import Path
os.environ[sys.argv[1]] = "0"
from speedkv.kernels import native
root, source_dir, names = Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
while names:
    for name in list(names):
        if native.needs_build(root, name, source_dir):
            try:
                native.load_kernel(root, name, source_dir)
            except native.KernelUnavailable:
                pass
        if not native.needs_build(root, name, source_dir):
            names.remove(name)
    if names:
        time.sleep(0.5)
"""


def build_missing(
    root: Path, names: tuple[str, ...] = tuple(KERNELS), source_dir: Path = CSRC
) -> None:
    """Compile the kernels that have neither a library nor a recorded failure here, on several
    cores at once. A process registers a library's operators once, so each builder is a process
    of its own; each starts at a different place in the list and skips what another is
    building, so a first start takes about the time of the slowest share instead of the sum.
    Builders take each kernel's own lock, as load_kernel does, so processes starting together
    share the work too; what a builder did not finish, the caller's load_kernel builds."""
    missing = [name for name in names if needs_build(root, name, source_dir)]
    workers = min(len(missing), _builders())
    if workers < 2:
        return
    log(f"compiling {len(missing)} of speedkv's kernels into {root}, {workers} at a time (once)")
    # no longer than one lock wait: a builder stuck behind a hung holder gives its kernels back
    # to load_kernel, whose own wait is bounded the same way
    timeout = float(os.environ.get(LOCK_TIMEOUT, "600"))

    def build(worker: int) -> None:
        first = worker * len(missing) // workers
        order = missing[first:] + missing[:first]
        command = [sys.executable, "-c", BUILDER, LOCK_TIMEOUT, str(root), str(source_dir), *order]
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(command, stdout=subprocess.DEVNULL, timeout=timeout, check=False)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(build, range(workers)))


def needs_build(root: Path, name: str, source_dir: Path = CSRC) -> bool:
    """Whether kernel `name` has neither a library nor a recorded failure under `root`."""
    build = build_dir(root, name, source_dir)
    return not (build / f"speedkv_{name}.so").is_file() and not (build / "FAILED").is_file()


def _builders() -> int:
    """SPEEDKV_KERNEL_BUILD_JOBS if it is a positive count, else the cores this process may use."""
    value = os.environ.get(BUILD_JOBS, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else _usable_cores()


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def has_prefill_kernel(ops) -> bool:
    """Whether `ops` (from `native_ops`) has the bfloat16 prefill kernel: it is compiled only
    for CPUs with the AVX512-BF16 instructions."""
    return ops is not None and hasattr(ops, "causal_attention")


def has_linear_kernel(ops) -> bool:
    """Whether `ops` has the bfloat16 decode linear kernel (CPUs with AVX512-BF16, or AVX2
    and FMA)."""
    return ops is not None and hasattr(ops, "packed_linear")


def kernels_root() -> Path:
    """This machine's directory of built kernels: the compiler's target and version, torch's
    version and the flags name it."""
    version, isa = compiler_target()
    digest = hashlib.sha256()
    for part in (version, *isa, *flags(), torch.__version__, platform.machine()):
        digest.update(part.encode() + b"\0")
    return cache_dir() / "kernels" / digest.hexdigest()[:16]


def compiler_target() -> tuple[str, tuple[str, ...]]:
    """The C++ compiler's version line and the instruction-set macros it predefines for the
    target flags here (`__AVX512BF16__ 1`, `__ARM_NEON 1`, ...)."""
    return _compiler_target(os.environ.get("CXX", "c++"), tuple(flags()[1:-1]))


@functools.cache
def _compiler_target(compiler: str, target: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    try:
        version = _run([compiler, "--version"]).splitlines()[0]
        macros = _run([compiler, *target, "-dM", "-E", "-x", "c++", os.devnull])
    except (OSError, subprocess.CalledProcessError) as error:
        raise KernelUnavailable(f"no working C++ compiler ({compiler}): {error}") from None
    found = (ISA_MACRO.match(line) for line in macros.splitlines())
    return version, tuple(sorted(f"{m[1]} {m[2]}".strip() for m in found if m))


def load_kernel(root: Path, name: str, source_dir: Path = CSRC) -> Path:
    """Load kernel `name`'s library, building it first if this machine has none yet; raise
    KernelUnavailable if it cannot be built (recorded, so later processes do not retry)."""
    build = build_dir(root, name, source_dir)
    library = build / f"speedkv_{name}.so"
    failed = build / "FAILED"
    if failed.is_file():
        raise KernelUnavailable(failed.read_text().strip() + f" (recorded in {failed})")
    if library.is_file():
        return _load(library, failed)
    build.mkdir(parents=True, exist_ok=True)
    timeout = float(os.environ.get(LOCK_TIMEOUT, "600"))
    with exclusive(build / "build.lock", timeout) as held:
        if not held:
            raise KernelUnavailable(f"another process has been building it for {timeout:.0f} s")
        if not library.is_file():  # another process may have built it while this one waited
            (build / "lock").unlink(missing_ok=True)  # torch's, left by a build killed halfway
            log(f"compiling speedkv's {name} kernel into {build} (once for this machine)")
            try:
                _compile(name, source_dir / f"{name}.cpp", build)
            except Exception as error:  # noqa: BLE001 - any build failure: use torch's kernel
                built = isinstance(error, OSError) and library.is_file()  # torch's loader's
                summary = _does_not_load(error) if built else _last_line(error)
                failed.write_text(summary + "\n")
                raise KernelUnavailable(summary) from None
    return _load(library, failed)


def build_dir(root: Path, name: str, source_dir: Path = CSRC) -> Path:
    """Where kernel `name` is built: one folder per version of its source."""
    return root / f"{name}-{_source_key(name, source_dir)}"


def _load(library: Path, failed: Path) -> Path:
    """Load a built library; one that does not load (a symbol this torch lacks) is recorded
    as failed, like a build that failed."""
    try:
        torch.ops.load_library(str(library))
    except OSError as error:
        summary = _does_not_load(error)
        failed.write_text(summary + "\n")
        raise KernelUnavailable(summary) from None
    return library


def _does_not_load(error: OSError) -> str:
    """What a built library that fails to load is recorded as: the loader's own reason."""
    return f"its library does not load: {_last_line(error.__cause__ or error)}"


def kernel_status(root: Path | None = None) -> dict[str, str]:
    """Each kernel's state on this machine: built, failed (and why), or not built yet."""
    root = root or kernels_root()
    status = {}
    for name in KERNELS:
        build = build_dir(root, name)
        if (build / f"speedkv_{name}.so").is_file():
            status[name] = "built"
        elif (build / "FAILED").is_file():
            status[name] = "failed: " + (build / "FAILED").read_text().strip()
        else:
            status[name] = "not built"
    return status


def _compile(name: str, source: Path, build: Path) -> None:
    from torch.utils.cpp_extension import load

    with _ninja_on_path():
        load(
            name=f"speedkv_{name}",
            sources=[str(source)],
            build_directory=str(build),
            extra_cflags=flags(),
            extra_ldflags=["-fopenmp"],  # resolves to the libgomp torch already loaded
            is_python_module=False,
            verbose=False,
        )


def sources_key() -> str:
    """One digest of every kernel's source: what a measurement of the kernels depends on."""
    return hashlib.sha256(",".join(_source_key(n, CSRC) for n in KERNELS).encode()).hexdigest()


def _source_key(name: str, source_dir: Path) -> str:
    digest = hashlib.sha256((source_dir / f"{name}.cpp").read_bytes())
    for header in HEADERS:
        if (source_dir / header).is_file():
            digest.update((source_dir / header).read_bytes())
    return digest.hexdigest()[:10]


_reported: set[str] = set()


def _report(name: str, why: KernelUnavailable) -> None:
    """Warn once per process and kernel."""
    if name in _reported:
        return
    _reported.add(name)
    warnings.warn(
        f"speedkv's native {name} kernel is not available ({why}); using torch's kernels. "
        f"Set {SWITCH}=torch to skip the native kernels.",
        RuntimeWarning,
        stacklevel=3,
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


def _run(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def _last_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[-1] if text else error!r}"
