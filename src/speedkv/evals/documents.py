"""Prompts of a chosen token length: essay text with facts planted at chosen depths, wrapped
in the chat template with a question after the document: in the same user message
(`one_message`), or in a message of its own (`question_turn`, the layout of a cached document
asked a question).

The haystack comes from one essay split (evaluation uses "eval", wording design "calib"),
starting at a sentence offset the caller draws from its seeded RNG, and read again from its
start where a long prompt needs more text than the split holds. The prompt is fitted to
the target length by trimming the haystack word by word, so every length is hit to within
one word's tokens, and the facts stay at their fractional depth of the trimmed haystack.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from speedkv.errors import UserError
from speedkv.hf.text import EncodedPrompt, encode_messages, encode_prompt
from speedkv.prompts.haystack import haystack_text, sentences

Encode = Callable[[str], EncodedPrompt]  # a user message's text -> the prompt's ids


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


def one_message(tokenizer) -> Encode:
    """The text as the only user message, then the generation header."""
    return lambda text: encode_prompt(tokenizer, text)


def question_turn(tokenizer, question: str) -> Encode:
    """The text as a user message and `question` as the next one, then the generation header:
    a cached document asked a question (`deep=turn` keeps only the question's turn deep)."""
    return lambda text: encode_messages(
        tokenizer, [{"role": "user", "content": text}, {"role": "user", "content": question}]
    )


def document_turn(tokenizer) -> Encode:
    """The text as a user message and nothing after it: a document to cache and then ask."""
    return lambda text: encode_messages(
        tokenizer, [{"role": "user", "content": text}], generation_header=False
    )


def fit_message(
    tokenizer,
    length: int,
    render: Callable[[str], str],
    split: str,
    start: int,
    task: str,
    encode: Encode | None = None,
) -> tuple[str, EncodedPrompt]:
    """The user message `render(haystack)` and the chat-templated prompt around it (as
    `encode` lays it out; by default the only user message), with the longest haystack
    (whole words from sentence `start` of `split`) that keeps the prompt within `length`
    tokens."""
    # past the split's ~20K tokens its essays repeat: the facts are still said once
    text = haystack_text(tokenizer, length + 64, split=split, start=start, repeat=True)
    words = text.split(" ")
    layout = encode or one_message(tokenizer)

    def message(count: int) -> str:
        return render(" ".join(words[:count]))

    bare = len(layout(message(0)).ids)
    if bare > length:
        raise UserError(
            f"length {length} is too short for task {task}: its chat template, facts and "
            f"question alone take {bare} tokens"
        )
    low, high = 0, len(words)  # message(low) fits; find the largest count that fits
    while low < high:
        middle = (low + high + 1) // 2
        if len(layout(message(middle)).ids) <= length:
            low = middle
        else:
            high = middle - 1
    return message(low), layout(message(low))


def minimum_length(tokenizer, render: Callable[[str], str], encode: Encode | None = None) -> int:
    """Tokens the prompt takes with no haystack at all."""
    return len((encode or one_message(tokenizer))(render("")).ids)
