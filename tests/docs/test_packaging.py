"""What the package must carry besides Python: `py.typed` (it tells type checkers the package
is typed) and the native kernel's C++ source (built on first use), in the installed package
and in the wheel a build makes; and the LICENSE and CITATION.cff beside it."""

import shutil
import subprocess
import sys
import zipfile
from importlib.resources import files
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_installed_package_has_py_typed():
    assert files("speedkv").joinpath("py.typed").is_file()


def test_installed_package_has_the_native_kernel_sources():
    from speedkv.kernels.native import HEADERS, KERNELS

    for name in [*(f"{kernel}.cpp" for kernel in KERNELS), *HEADERS]:
        assert files("speedkv").joinpath(f"kernels/csrc/{name}").is_file(), name


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
    from speedkv.kernels.native import HEADERS, KERNELS

    sources = [*(f"{kernel}.cpp" for kernel in KERNELS), *HEADERS]
    assert {f"speedkv/kernels/csrc/{name}" for name in sources} <= set(names)


def test_license_and_citation_agree_with_the_package():
    """LICENSE holds the Apache License 2.0 that pyproject.toml names, and CITATION.cff cites
    this version of speedkv under it, with the SPEED paper among its references."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    yaml = pytest.importorskip("yaml")
    from speedkv.version import __version__

    licence = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] in ({"text": "Apache-2.0"}, "Apache-2.0")
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["cff-version"] == "1.2.0" and citation["type"] == "software"
    assert citation["version"] == __version__ and citation["license"] == "Apache-2.0"
    (paper,) = citation["references"]
    assert paper["title"].startswith("Shallow Prefill, Deep Decoding")
    assert paper["authors"][0]["family-names"] == "Oh" and paper["year"] == 2026
