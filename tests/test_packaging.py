"""What the package must carry besides Python: `py.typed` (it tells type checkers the package
is typed) and the native kernel's C++ source (built on first use), in the installed package
and in the wheel a build makes."""

import shutil
import subprocess
import sys
import zipfile
from importlib.resources import files
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_installed_package_has_py_typed():
    assert files("speedkv").joinpath("py.typed").is_file()


def test_installed_package_has_the_native_kernel_sources():
    from speedkv.core.native import HEADERS, KERNELS

    for name in [*(f"{kernel}.cpp" for kernel in KERNELS), *HEADERS]:
        assert files("speedkv").joinpath(f"core/csrc/{name}").is_file(), name


def test_wheel_ships_py_typed_and_the_kernel_source(tmp_path):
    # build from a copy, so the build leaves nothing in the working tree
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(
        ROOT / "src",
        tmp_path / "src",
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
    )
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(tmp_path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("speedkv-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "speedkv/py.typed" in names
    from speedkv.core.native import HEADERS, KERNELS

    sources = [*(f"{kernel}.cpp" for kernel in KERNELS), *HEADERS]
    assert {f"speedkv/core/csrc/{name}" for name in sources} <= set(names)
