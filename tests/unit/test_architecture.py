"""The layering is checked, not hoped for: import-linter's contracts in pyproject.toml hold for
the package, and they catch an import that points the wrong way."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


def import_cycles(package_parent: Path) -> list[list[str]]:
    """Every group of speedkv's modules that import each other round in a circle, counting
    imports inside functions and under TYPE_CHECKING (grimp's graph)."""
    code = """
import grimp, json, sys
graph = grimp.build_graph("speedkv", cache_dir=None)
index, low, stack, on, cycles = {}, {}, [], set(), []
sys.setrecursionlimit(10000)
def visit(v):
    index[v] = low[v] = len(index); stack.append(v); on.add(v)
    for w in graph.find_modules_directly_imported_by(v):
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        group = []
        while True:
            w = stack.pop(); on.discard(w); group.append(w)
            if w == v: break
        if len(group) > 1: cycles.append(sorted(group))
for module in sorted(graph.modules):
    if module not in index: visit(module)
print(json.dumps(cycles))
"""
    env = {"PYTHONPATH": str(package_parent), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=package_parent, check=True)  # fmt: skip
    import json

    return json.loads(done.stdout)


def test_no_module_imports_itself_round_a_circle():
    assert import_cycles(ROOT / "src") == []


def test_a_circle_inside_one_layer_is_caught(tmp_path):
    shutil.copytree(ROOT / "src" / "speedkv", tmp_path / "speedkv",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    int8 = tmp_path / "speedkv" / "hf" / "int8.py"
    int8.write_text(int8.read_text() + "\nfrom speedkv.hf.loading import LoadedModel  # noqa\n")
    (cycle,) = import_cycles(tmp_path)
    assert {"speedkv.hf.int8", "speedkv.hf.loading", "speedkv.hf.backbone"} <= set(cycle)
