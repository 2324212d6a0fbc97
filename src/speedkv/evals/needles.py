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

import math
import random
import re
import statistics
import string
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from speedkv.errors import UserError
from speedkv.evals.documents import (
    Fact,
    fit_message,
    minimum_length,
    one_message,
    plant_all,
    question_turn,
)
from speedkv.evals.render import cell, length_label, percent, pyplot, slug, wrap_spec
from speedkv.evals.task import Column, Services, Table, Task, Unit, base_record
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


# -- the tasks ----------------------------------------------------------------------------------
METHODOLOGY = """\
Every prompt goes through the model's chat template with the question after the document.
Lengths are total prompt tokens. The essay text is trimmed word by word to fit, so a prompt is
at most the length and within a few tokens of it. The haystack is essay text of the chosen
split from a sentence offset drawn from the seeded RNG; sample `i` uses the same needles and
offset at every length and sits at needle depth `depths[i mod len(depths)]`.

- **niah**: `There is an important piece of information hidden inside a lot of irrelevant
  text. Find it and memorize it. I will quiz you about it.`, the essays with
  `The pass key is 12345. Remember it. 12345 is the pass key.` planted between sentences, then
  `What is the pass key? Answer with the number only.` (40 new tokens, as for multikey:
  full answers in about 10, but a method may wrap the number in a longer sentence).
- **niah_multikey**: four needles `The pass key for the garden is 12345. Remember it. 12345 is
  the pass key for the garden.` with different things; one asked, `What is the pass key for
  the garden? Answer with the number only.`. The asked needle is at the grid depth, the other
  three at random depths.
- **niah_multivalue**: four needles `One of the pass keys for the garden is 12345. Remember
  it.`; `What are all the pass keys for the garden? Answer with the numbers only.`
  (64 new tokens); all four must be given.
- **vt**: `VAR ABCDE = 12345.`, then `VAR FGHIJ = VAR ABCDE.` and `VAR KLMNO = VAR FGHIJ.` later
  in the text; `Which variables are assigned the value 12345, directly or through another
  variable? Answer with the variable names only.` (64 new tokens); all three names must be
  given.

The multi-needle tasks open with the plural form of the instruction. The wording was chosen
on the `calib` split (full attention, 6 samples at 1K and at 2K). The classic pass-key needle
with its instruction line was retrieved every time. RULER's "special magic number" phrasing
and a bare "The secret number is N." each missed once at 2K: the answer was a stray number
from the essays. Scoring is exact match by containment, as in RULER:
a sample is correct when every expected value appears in the greedy answer as a whole number
(thousands separators ignored) or, for `vt`, as a whole word (case ignored). Every record in
`results.json` keeps the prompt length, depth, planted sentences, expected values and the
answer.
"""
ACCURACY = Table("exact-match accuracy", "score", percent)
RECALL = Table("share of expected values in the answer (recall)", "recall", percent)


class NeedleTask(Task):
    """A needle task: every method answers the same sample's question; with --shared-prefill,
    full and SPEED start from one full prefill of the prompt."""

    methodology = METHODOLOGY

    def __init__(
        self,
        name: str,
        description: str,
        default_samples: int,
        headline: Column,
        tables: tuple[Table, ...] = (ACCURACY,),
    ):
        self.name, self.description, self.default_samples = name, description, default_samples
        self.max_new_tokens = MAX_NEW_TOKENS[name]
        self.headline, self.tables_shown = headline, tables

    def check_settings(self, ctx: Services) -> None:
        depths = ctx.config.depths
        if any(not 0.0 <= d <= 1.0 for d in depths) or not depths:
            raise UserError(f"depths must be fractions between 0 and 1, got {depths}")

    def validate(self, ctx: Services, length: int) -> None:
        needed = 2 * shortest_prompt(ctx.model.tokenizer, self.name, ctx.config.question_turn)
        if length < needed:
            raise UserError(
                f"length {length} is too short for task {self.name}: it needs at least "
                f"{needed} tokens (half of them essay text)"
            )
        self.check_room(ctx, length, self.max_new_tokens)

    def run(
        self, ctx: Services, unit: Unit, methods: list[str], records: list[dict]
    ) -> Iterator[dict]:
        cfg = ctx.config
        sample = build_sample(
            ctx.model.tokenizer, unit.task, unit.length, unit.index, cfg.seed, cfg.depths,
            cfg.split, cfg.question_turn,
        )  # fmt: skip
        shared, share_s = ctx.shared_prefixes(sample.prompt, methods)
        for method in methods:
            t0 = time.perf_counter() - (share_s if method in shared else 0.0)
            g = ctx.generate(method, sample.prompt, self.max_new_tokens, shared.get(method))
            found = found_values(g.text, sample.expected)
            yield {
                **base_record(method, unit, len(sample.prompt.ids)),
                "depth": sample.depth,
                "start": sample.start,
                "expected": sample.expected,
                "answer": g.text,
                "found": found,
                "correct": len(found) == len(sample.expected),
                "score": float(len(found) == len(sample.expected)),
                "recall": len(found) / len(sample.expected),
                "output_tokens": len(g.output_ids),
                "finish_reason": g.finish_reason,
                "question": sample.question,
                "facts": sample.facts,
                "seconds": time.perf_counter() - t0,
            }

    def summarise(self, records: list[dict]) -> dict:
        by_depth: dict[float, list[float]] = {}
        for r in records:
            by_depth.setdefault(r["depth"], []).append(r["score"])
        return {
            "recall": statistics.fmean(r["recall"] for r in records) if records else None,
            "by_depth": {str(d): statistics.fmean(v) for d, v in sorted(by_depth.items())},
        }

    def miss(self, record: dict) -> tuple[list[str], str] | None:
        return None if record["correct"] else (record["expected"], cell(record["answer"]))

    def plot(self, result: dict, out: Path) -> list[Path]:
        return plot_needles(result, out)


NEEDLES = (
    NeedleTask(
        "niah", "single needle: a 5-digit pass key, asked back", 10, Column("score", "niah")
    ),
    NeedleTask(
        "niah_multikey",
        "four pass keys for four named things; one asked",
        4,
        Column("score", "multikey"),
    ),
    NeedleTask(
        "niah_multivalue",
        "four pass keys for one thing; all four asked",
        3,
        Column("recall", "multivalue recall"),
        (ACCURACY, RECALL),
    ),
    NeedleTask(
        "vt",
        "variable tracking: a chain of three assignments; every variable holding the value",
        3,
        Column("recall", "vt recall"),
        (ACCURACY, RECALL),
    ),
)


def plot_needles(result: dict, out: Path) -> list[Path]:
    """Per method, one PNG of depth x length accuracy heatmaps, a panel per needle task."""
    rows = [r for r in result["summary"] if r["task"] in NEEDLE_TASKS]
    if not rows:
        return []
    plt = pyplot()
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    depths = sorted(
        {float(d) for d in result["config"]["depths"]}
        | {float(d) for r in rows for d in r["by_depth"]}
    )
    lengths = sorted({r["length"] for r in rows})
    written = []
    for method in dict.fromkeys(r["method"] for r in rows):
        fig, axes = plt.subplots(
            1, len(tasks), figsize=(1.6 + 1.5 * len(lengths) * len(tasks), 0.9 + 0.6 * len(depths))
        )
        axes = [axes] if len(tasks) == 1 else list(axes)
        for ax, task in zip(axes, tasks):
            cells = {
                r["length"]: r["by_depth"]
                for r in rows
                if r["method"] == method and r["task"] == task
            }
            grid = [[cells.get(n, {}).get(str(d), math.nan) for n in lengths] for d in depths]
            ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for i, line in enumerate(grid):
                for j, value in enumerate(line):
                    label = "–" if math.isnan(value) else f"{100 * value:.0f}"
                    ax.text(j, i, label, ha="center", va="center", fontsize=9)
            ax.set_xticks(range(len(lengths)), [length_label(n) for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("needle depth")
            ax.set_title(task, fontsize=10)
        fig.suptitle(f"{wrap_spec(method, 100)}: accuracy %", fontsize=9)
        fig.tight_layout()
        path = out / f"heatmap_{slug(method)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
