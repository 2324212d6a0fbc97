"""Prompts of a chosen token length: essay text with facts planted at chosen depths, wrapped
in the chat template with a question after the document.

The haystack comes from one essay split (evaluation uses "eval", wording design "calib"),
starting at a sentence offset the caller draws from its seeded RNG. The prompt is fitted to
the target length by trimming the haystack word by word, so every length is hit to within
one word's tokens, and the facts stay at their fractional depth of the trimmed haystack.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from speedkv.errors import UserError
from speedkv.hf.text import EncodedPrompt, encode_prompt
from speedkv.prompts.haystack import haystack_text, sentences


@dataclass(frozen=True)
class Fact:
    text: str
    depth: float  # 0 = before the first sentence, 1 = after the last


def plant_all(haystack: str, facts: list[Fact]) -> str:
    """Insert every fact between sentences at its depth; facts at the same place keep their
    order in `facts` (so a chain of assignments stays in order)."""
    parts = sentences(haystack)
    slots: dict[int, list[str]] = {}
    for fact in facts:
        slots.setdefault(round(fact.depth * len(parts)), []).append(fact.text)
    out: list[str] = []
    for index in range(len(parts) + 1):
        out.extend(slots.get(index, []))
        if index < len(parts):
            out.append(parts[index])
    return " ".join(out)


def fit_prompt(
    tokenizer, length: int, render: Callable[[str], str], split: str, start: int, task: str
) -> EncodedPrompt:
    """The chat-templated prompt whose user message is `render(haystack)`, with the longest
    haystack (whole words from sentence `start` of `split`) that keeps it within `length`
    tokens."""
    words = haystack_text(tokenizer, length + 64, split=split, start=start).split(" ")

    def encode(count: int) -> EncodedPrompt:
        return encode_prompt(tokenizer, render(" ".join(words[:count])))

    bare = len(encode(0).ids)
    if bare > length:
        raise UserError(
            f"length {length} is too short for task {task}: its chat template, facts and "
            f"question alone take {bare} tokens"
        )
    low, high = 0, len(words)  # encode(low) fits; find the largest count that fits
    while low < high:
        middle = (low + high + 1) // 2
        if len(encode(middle).ids) <= length:
            low = middle
        else:
            high = middle - 1
    return encode(low)


def minimum_length(tokenizer, render: Callable[[str], str]) -> int:
    """Tokens the prompt takes with no haystack at all."""
    return len(encode_prompt(tokenizer, render("")).ids)
