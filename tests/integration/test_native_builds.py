"""How the native kernels are built, on any machine: a build killed halfway leaves the next
start working in bounded time, a kernel that does not compile leaves the others in use and is
not retried by every process, the build key is what the compiler targets, and where the
vectors are narrower (NEON's 4 float lanes) a head size the kernel cannot tile goes to torch."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from speedkv.kernels import attention, native

ROOT = Path(__file__).resolve().parents[2]
LOADER = """
import sys
from pathlib import Path
from speedkv.kernels import native
print(native.load_kernel(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])), flush=True)
"""


def compiler_available() -> bool:
    try:
        native.compiler_target()
    except native.KernelUnavailable:
        return False
    return True


needs_compiler = pytest.mark.skipif(not compiler_available(), reason="no C++ compiler here")


def loader(root: Path, name: str, sources: Path = native.CSRC) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LOADER, str(root), name, str(sources)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


@needs_compiler
def test_a_build_killed_halfway_leaves_the_next_start_working(tmp_path):
    """kill -9 during the compile: the flock dies with the process, torch's own lock file is
    left behind, and the next start removes it and builds."""
    first = loader(tmp_path, "layer_ops")
    build = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and build is None:  # until ninja has been started
        build = next(iter(tmp_path.glob("layer_ops-*/build.ninja")), None)
        time.sleep(0.05)
    assert build is not None, first.communicate()[1][-2000:]
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    (build.parent / "lock").touch()  # torch's lock, as a builder killed while holding it leaves
    start = time.monotonic()
    second = loader(tmp_path, "layer_ops")
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, err[-2000:]
    assert Path(out.strip()).is_file() and time.monotonic() - start < 300


@needs_compiler
def test_missing_kernels_are_built_side_by_side_and_failures_recorded(tmp_path, monkeypatch):
    """A first start builds on several cores: one process per builder, each skipping what
    another holds; a kernel that does not compile is recorded, and nothing is left to build."""
    sources = tmp_path / "csrc"
    sources.mkdir()
    names = ("tiny_a", "tiny_b", "tiny_c", "broken")
    for value, name in enumerate(names[:3]):
        (sources / f"{name}.cpp").write_text(f"int {name}() {{ return {value}; }}\n")
    (sources / "broken.cpp").write_text("this is not C++\n")
    root = tmp_path / "built"
    monkeypatch.setattr(native, "_usable_cores", lambda: 2)
    native.build_missing(root, names, sources)
    for name in names[:3]:
        assert (native.build_dir(root, name, sources) / f"speedkv_{name}.so").is_file()
    assert (native.build_dir(root, "broken", sources) / "FAILED").is_file()
    assert not any(native.needs_build(root, name, sources) for name in names)


LOAD_EACH = """
import sys
from pathlib import Path
from speedkv.kernels import native
for name in sys.argv[3:]:
    try:
        native.load_kernel(Path(sys.argv[1]), name, Path(sys.argv[2]))
        print(name, "loaded", flush=True)
    except native.KernelUnavailable as why:
        print(name, "unavailable:", why, flush=True)
"""


@needs_compiler
def test_a_kernel_that_does_not_compile_or_load_leaves_the_others(tmp_path):
    """Each start in a process of its own: a library registers its operators once per
    process. Small sources stand in for the kernels: what is tested is the build's
    bookkeeping, which every kernel shares."""
    sources = tmp_path / "csrc"
    sources.mkdir()
    (sources / "layer_ops.cpp").write_text("int layer_ops_here() { return 1; }\n")
    (sources / "decode_linear.cpp").write_text("this is not C++\n")
    # compiles and links, but names a symbol no library defines: loading it fails
    (sources / "tile_linear.cpp").write_text("int nowhere();\nint call() { return nowhere(); }\n")
    command = [sys.executable, "-c", LOAD_EACH, str(tmp_path / "built"), str(sources),
               "decode_linear", "tile_linear", "layer_ops"]  # fmt: skip
    first = subprocess.run(command, capture_output=True, text=True, timeout=600).stdout
    assert "decode_linear unavailable: " in first and "layer_ops loaded" in first, first
    assert "tile_linear unavailable: its library does not load" in first, first
    # recorded: the next process reads the failures instead of compiling or loading again
    again = subprocess.run(command, capture_output=True, text=True, timeout=600).stdout
    assert again.count("recorded in") == 2 and "layer_ops loaded" in again, again


def test_the_build_key_is_what_the_compiler_targets(monkeypatch):
    """Two machines whose compilers target other instructions (or another compiler version)
    never share a library, whatever /proc/cpuinfo says."""
    if not compiler_available():
        pytest.skip("no C++ compiler here")
    here = native.kernels_root()
    version, isa = native.compiler_target()
    assert any(macro.startswith(("__AVX", "__SSE", "__ARM", "__aarch64")) for macro in isa)
    for other in [(version, (*isa, "__AMX_BF16__ 1")), (version + " (patched)", isa)]:
        monkeypatch.setattr(native, "compiler_target", lambda other=other: other)
        assert native.kernels_root() != here


def test_without_a_compiler_the_kernels_are_unavailable(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(native.KernelUnavailable, match="no working C\\+\\+ compiler"):
        native.kernels_root()


def test_the_target_flags_name_the_build(monkeypatch):
    """A build for fewer instructions (the tests force one without AVX512-BF16) is a build of
    its own, beside the native one."""
    if not compiler_available():
        pytest.skip("no C++ compiler here")
    here = native.kernels_root()
    monkeypatch.setenv(native.ARCH, "-march=x86-64-v2" if "x86" in native.compiler_target()[1][-1]
                       else "-march=armv8-a")  # fmt: skip
    assert native.kernels_root() != here
    assert not any("AVX512" in macro for macro in native.compiler_target()[1])


class NarrowVectors:
    """A native decode kernel built for 4 float lanes (NEON on aarch64): head sizes 8 to 64."""

    def __init__(self):
        self.calls = 0

    def decode_attention_lanes(self):
        return 4

    def decode_attention(self, q, keys, values, scale):
        self.calls += 1
        return torch.zeros_like(q)


@pytest.mark.parametrize(("dim", "native_runs"), [(64, True), (128, False), (48, False)])
def test_head_sizes_the_vectors_cannot_tile_go_to_torch(monkeypatch, dim, native_runs):
    ops = NarrowVectors()
    monkeypatch.setattr(attention, "engine_kernels", lambda: ops)
    keys = [torch.randn(2, 5, dim), torch.randn(2, 7, dim)]
    out = attention.batch_decode_attention(torch.randn(2, 4, 1, dim), keys, keys)
    assert out.shape == (2, 4, 1, dim) and (ops.calls == 1) == native_runs


def test_values_laid_out_unlike_their_keys_go_to_torch(monkeypatch):
    ops = NarrowVectors()
    monkeypatch.setattr(attention, "engine_kernels", lambda: ops)
    keys = [torch.randn(2, 5, 32)]
    values = [torch.randn(2, 32, 5).transpose(1, 2)]  # columns, not rows
    attention.batch_decode_attention(torch.randn(1, 4, 1, 32), keys, values)
    assert ops.calls == 0


CROSS = shutil.which("aarch64-linux-gnu-g++")
CROSS_FLAGS = ["-std=c++17", "-O2", "-march=armv8.2-a", "-fopenmp"]


@pytest.fixture(scope="module")
def aarch64_headers(tmp_path_factory) -> list[str]:
    """Include flags for torch's headers, with ATen.h (every kernel's first include, and most of
    a kernel's parse) precompiled once for aarch64: six parses of it would take a minute and a
    half. GCC takes `ATen/ATen.h.gch` from the first include folder in place of the header."""
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{path}" for path in include_paths()]
    folder = tmp_path_factory.mktemp("aarch64-pch")
    (folder / "ATen").mkdir()
    header = next(Path(p) / "ATen" / "ATen.h" for p in include_paths()
                  if (Path(p) / "ATen" / "ATen.h").is_file())  # fmt: skip
    command = [CROSS, *CROSS_FLAGS, *includes, "-x", "c++-header", str(header),
               "-o", str(folder / "ATen" / "ATen.h.gch")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [f"-I{folder}", *includes]


@pytest.mark.skipif(CROSS is None, reason="no aarch64 cross compiler (g++-aarch64-linux-gnu)")
@pytest.mark.parametrize("name", sorted(native.KERNELS))
def test_every_kernel_compiles_for_aarch64(name, aarch64_headers):
    """Each kernel source compiles for arm64 (NEON) against this torch's headers: the build a
    Graviton or an arm64 container would run, checked here without one."""
    command = [CROSS, *CROSS_FLAGS, "-fsyntax-only", "-H", *aarch64_headers,
               str(native.CSRC / f"{name}.cpp")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    # -H lists the headers read, a precompiled one that was used marked "!"
    assert re.search(r"^! \S+/ATen/ATen\.h\.gch$", done.stderr, re.M), done.stderr[:3000]
    assert done.returncode == 0, done.stderr[-3000:]
