"""Training text that no evaluation uses: the Python standard library's own documentation.

It ships with every Python, so it is offline and the same on every machine with the same
Python version. Two parts, each a named document:

- `topic/<name>`: the Language Reference sections behind `help()` (`pydoc_data.topics`),
- `doc/<module>.<object>`: docstrings of the standard library's modules, classes and
  functions of at least `MIN_DOC_CHARS` characters (test suites left out), with doctest and
  indented code lines removed so what remains reads as prose.

RULER's haystacks (Paul Graham essays, SQuAD, HotpotQA, its noise sentences and word lists)
and speedkv's own evaluation haystack (the essays) share no text with it.
"""

from __future__ import annotations

import ast
import re
import sysconfig
from functools import lru_cache
from pathlib import Path

MIN_DOC_CHARS = 300
LONGEST_SENTENCE_CHARS = 600  # longer runs (tables, lists) are cut at spaces into pieces
_SKIPPED_DIRS = ("test", "tests", "idle_test", "site-packages", "__pycache__")
_CODE_LINE = re.compile(r"^\s*(>>>|\.\.\.\s|\$ |\|)")


@lru_cache(maxsize=1)
def python_docs() -> dict[str, str]:
    """Document name -> text as one line of prose, in a fixed (sorted) order."""
    out: dict[str, str] = {}
    import pydoc_data.topics as topics

    for name, text in sorted(topics.topics.items()):
        out[f"topic/{name}"] = _prose(text)
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if any(part in _SKIPPED_DIRS or part.startswith("test") for part in relative.parts):
            continue
        module = ".".join(relative.with_suffix("").parts)
        for name, doc in _docstrings(path):
            if len(doc) >= MIN_DOC_CHARS:
                out[f"doc/{module}{name}"] = _prose(doc)
    return {name: text for name, text in out.items() if text}


def _docstrings(path: Path) -> list[tuple[str, str]]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                name = "" if isinstance(node, ast.Module) else f".{node.name}"
                found.append((f"{name}@{getattr(node, 'lineno', 0)}", doc))
    return found


def _prose(text: str) -> str:
    """Doctest, shell and indented code lines dropped; the rest joined into one line."""
    kept = [
        line
        for line in text.splitlines()
        if not _CODE_LINE.match(line) and not line.startswith(("    ", "\t"))
    ]
    return " ".join(" ".join(kept).split())


def cut_long(sentence: str) -> list[str]:
    """A sentence as pieces of at most LONGEST_SENTENCE_CHARS characters, cut at spaces."""
    if len(sentence) <= LONGEST_SENTENCE_CHARS:
        return [sentence]
    pieces, current = [], ""
    for word in sentence.split(" "):
        if current and len(current) + 1 + len(word) > LONGEST_SENTENCE_CHARS:
            pieces.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    return pieces + ([current] if current else [])
