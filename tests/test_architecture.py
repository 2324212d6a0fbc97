"""The layering is checked, not hoped for: import-linter's contracts in pyproject.toml hold for
the package, and they catch an import that points the wrong way."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = [
    sys.executable,
    "-c",
    "from importlinter.cli import lint_imports_command; lint_imports_command()",
]


def lint(package_parent: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(package_parent), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [*LINT, "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        capture_output=True, text=True, env=env, cwd=package_parent,
    )  # fmt: skip


def test_import_contracts_hold():
    done = lint(ROOT / "src")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 3 kept, 0 broken." in done.stdout


def test_an_upward_import_breaks_the_layers(tmp_path):
    shutil.copytree(ROOT / "src" / "speedkv", tmp_path / "speedkv",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    cache = tmp_path / "speedkv" / "core" / "cache.py"
    cache.write_text(cache.read_text() + "\nfrom speedkv.cli.app import main  # noqa\n")
    done = lint(tmp_path)
    assert done.returncode != 0
    assert "speedkv.core.cache -> speedkv.cli.app" in done.stdout
