"""Needle-in-a-haystack tasks, RULER-style, over the Paul Graham essays.

- `niah`: one pass key (a 5-digit number) planted in the essays; asked back.
- `niah_multikey`: four pass keys, each for a different named thing; one of them is asked.
- `niah_multivalue`: four pass keys for the same thing; all four must be given.
- `vt`: variable tracking, a chain `VAR A = 12345. ... VAR B = VAR A. ... VAR C = VAR B.`;
  every variable holding the value must be named.

Wording (chosen on the calib split; see docs/results.md): an instruction line, the document,
a blank line, then the question. The pass-key phrasing with its repetition ("Remember it.
12345 is the pass key.") is the classic passkey-retrieval needle; with full attention
SmolLM2-135M retrieved it in every calib trial, where RULER's "special magic number" phrasing
sometimes drew a stray number from the essays instead.

With `question_turn`, the question is a user message of its own after the document's, as
when a cached document is asked (`deep=turn` then keeps only the question's turn deep).

The asked needle (or the first value, or the head of the chain) sits at the sample's grid
depth; the other needles at depths drawn from the sample's RNG. Scoring is exact match by
containment: every expected value must appear in the answer as a whole number (thousands
separators ignored) or, when it is a word (`vt`'s names), as a whole word (case ignored).
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass

from speedkv.evals.documents import (
    Fact,
    fit_message,
    minimum_length,
    one_message,
    plant_all,
    question_turn,
)
from speedkv.hf.text import EncodedPrompt
from speedkv.prompts.haystack import sentence_count

NEEDLE_TASKS = ("niah", "niah_multikey", "niah_multivalue", "vt")
MAX_NEW_TOKENS = {"niah": 40, "niah_multikey": 40, "niah_multivalue": 64, "vt": 64}
NEEDLES_PER_SAMPLE = 4  # multikey: keys planted; multivalue: values for the asked key
CHAIN_LENGTH = 3  # vt: variables in the chain (two hops)

INTRO_ONE = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it."
)
INTRO_MANY = (
    "There are important pieces of information hidden inside a lot of irrelevant text. "
    "Find them and memorize them. I will quiz you about them."
)
KEYS = (
    "garden", "river", "window", "mountain", "harbor", "library", "bridge", "forest",
    "castle", "island", "market", "station", "tower", "valley", "meadow", "canyon",
)  # fmt: skip


@dataclass
class NeedleSample:
    task: str
    index: int
    depth: float  # grid depth of the asked needle (multivalue: first value; vt: chain head)
    start: int  # haystack sentence offset in the split
    prompt: EncodedPrompt
    question: str
    expected: list[str]  # every value the answer must contain
    facts: list[dict]  # each planted sentence and its depth


@dataclass
class Design:
    """What one sample plants and asks, before it meets a haystack."""

    intro: str
    facts: list[Fact]
    question: str
    expected: list[str]

    def document(self, haystack: str) -> str:
        return f"{self.intro}\n\n{plant_all(haystack, self.facts)}"

    def render(self, haystack: str) -> str:
        return f"{self.document(haystack)}\n\n{self.question}"


def sample_rng(seed: int, task: str, index: int) -> random.Random:
    """The sample's own RNG: the same (seed, task, index) gives the same needles and haystack
    start at every length, so lengths differ only in how much essay surrounds them."""
    return random.Random(f"{seed}/{task}/{index}")


def design(task: str, depth: float, rng: random.Random) -> Design:
    values = [str(v) for v in rng.sample(range(10000, 100000), NEEDLES_PER_SAMPLE)]
    if task == "niah":
        v = values[0]
        fact = f"The pass key is {v}. Remember it. {v} is the pass key."
        return Design(
            INTRO_ONE,
            [Fact(fact, depth)],
            "What is the pass key? Answer with the number only.",
            [v],
        )
    if task == "niah_multikey":
        keys = rng.sample(KEYS, NEEDLES_PER_SAMPLE)
        depths = [depth] + [rng.random() for _ in keys[1:]]
        facts = [
            Fact(
                f"The pass key for the {k} is {v}. Remember it. {v} is the pass key for the {k}.", d
            )
            for k, v, d in zip(keys, values, depths)
        ]
        question = f"What is the pass key for the {keys[0]}? Answer with the number only."
        return Design(INTRO_MANY, facts, question, [values[0]])
    if task == "niah_multivalue":
        key = rng.choice(KEYS)
        depths = [depth] + [rng.random() for _ in values[1:]]
        facts = [
            Fact(f"One of the pass keys for the {key} is {v}. Remember it.", d)
            for v, d in zip(values, depths)
        ]
        question = f"What are all the pass keys for the {key}? Answer with the numbers only."
        return Design(INTRO_MANY, facts, question, values)
    if task == "vt":
        names = variable_names(rng, CHAIN_LENGTH)
        depths = [depth] + sorted(depth + (1 - depth) * rng.random() for _ in names[1:])
        texts = [f"VAR {names[0]} = {values[0]}."] + [
            f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])
        ]
        question = (
            f"Which variables are assigned the value {values[0]}, directly or through another "
            "variable? Answer with the variable names only."
        )
        facts = [Fact(t, d) for t, d in zip(texts, depths)]
        return Design(INTRO_MANY, facts, question, names)
    raise ValueError(f"not a needle task: {task}")


def variable_names(rng: random.Random, count: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    return names


def build_sample(
    tokenizer,
    task: str,
    length: int,
    index: int,
    seed: int,
    depths: list[float],
    split: str = "eval",
    own_turn: bool = False,
) -> NeedleSample:
    """Sample `index` of `task` at `length` prompt tokens; all randomness from `seed`. With
    `own_turn`, the question is a user message of its own after the document's."""
    rng = sample_rng(seed, task, index)
    depth = depths[index % len(depths)]
    start = rng.randrange(sentence_count(split))
    plan = design(task, depth, rng)
    if own_turn:
        encode = question_turn(tokenizer, plan.question)
        _, prompt = fit_message(tokenizer, length, plan.document, split, start, task, encode)
    else:
        _, prompt = fit_message(tokenizer, length, plan.render, split, start, task)
    return NeedleSample(
        task=task,
        index=index,
        depth=depth,
        start=start,
        prompt=prompt,
        question=plan.question,
        expected=plan.expected,
        facts=[{"text": f.text, "depth": round(f.depth, 4)} for f in plan.facts],
    )


def shortest_prompt(tokenizer, task: str, own_turn: bool = False) -> int:
    """Tokens a sample of `task` takes with no essay text around its needles."""
    plan = design(task, 0.5, sample_rng(0, task, 0))
    if own_turn:
        return minimum_length(tokenizer, plan.document, question_turn(tokenizer, plan.question))
    return minimum_length(tokenizer, plan.render, one_message(tokenizer))


_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def found_values(answer: str, expected: list[str]) -> list[str]:
    """The expected values the answer contains: a number as a whole number (thousands
    separators ignored), a word as a whole word (case ignored)."""
    numbers = set(re.findall(r"\d+", _THOUSANDS.sub("", answer)))
    words = {w.upper() for w in re.findall(r"[A-Za-z]+", answer)}
    return [e for e in expected if (e in numbers if e.isdigit() else e.upper() in words)]
