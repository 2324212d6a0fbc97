"""Prompts built from the haystack essays: exact-length raw passages, chat prompts about a
passage, an exact-length chat prompt, a document of a chosen length to cache, and random
passages for training data.

Earlier runs' evaluation records, benchmark prompts and training data were made by these
builders, so for the same arguments they must keep producing the same token ids.
"""

from __future__ import annotations

import random

from speedkv.errors import UserError
from speedkv.hf.text import encode_prompt
from speedkv.prompts.haystack import haystack_text, sentence_pool, take_sentences

# Essay text is encoded a little past the length wanted, then cut: tokens can merge across
# sentence boundaries, so the sentences' own counts do not add up exactly.
MARGIN = 64
# Tokens a question's chat turn adds to a cached document at most, with the generation header:
# the room a document must leave in the context for the questions asked of it.
QUESTION_ROOM = 48


def raw_passage(tokenizer, tokens: int, split: str, start: int) -> list[int]:
    """Exactly `tokens` ids of essay text from sentence `start` of `split`, encoded as a
    document: raw text with the tokenizer's own special tokens, no chat template."""
    text = haystack_text(tokenizer, tokens + MARGIN, split=split, start=start)
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    if len(ids) < tokens:
        raise UserError(f"the {split} essays are too short for a {tokens}-token passage")
    return list(ids[:tokens])


def passage_prompt(tokenizer, passage: str, request: str) -> list[int]:
    """A chat prompt (through the template) whose user message is `passage`, a blank line and
    `request`."""
    return encode_prompt(tokenizer, f"{passage}\n\n{request}").ids


def exact_chat_prompt(tokenizer, length: int, start: int = 0) -> list[int]:
    """Exactly `length` ids: the chat template around essay text from sentence `start` on, so
    position 0 is the template's first token (the BoS anchor) and the prompt ends with the
    generation header."""
    head, tail = _template_around(tokenizer, generation_header=True)
    body_len = _room(length, head, tail)
    text = haystack_text(tokenizer, body_len + MARGIN, start=start)
    body = tokenizer(text, add_special_tokens=False)
    return head + body["input_ids"][:body_len] + tail


def chat_document(tokenizer, length: int) -> str:
    """Essay text that, sent as the only user message of a chat and cached without a
    question (`Engine.prefill`), takes at most `length` tokens and within a few of it."""
    head, tail = _template_around(tokenizer, generation_header=False)
    room = _room(length, head, tail)
    body = tokenizer(haystack_text(tokenizer, room + MARGIN), add_special_tokens=False)
    while True:  # decoding and re-encoding can merge tokens differently: trim until it fits
        text = tokenizer.decode(body["input_ids"][:room]).strip()
        over = len(head) + len(tokenizer(text, add_special_tokens=False)["input_ids"])
        over += len(tail) - length
        if over <= 0:
            return text
        room -= over


def _room(length: int, head: list[int], tail: list[int]) -> int:
    """Tokens left for text between the template's `head` and `tail`; at least one."""
    room = length - len(head) - len(tail)
    if room < 1:
        raise UserError(
            f"length {length} is too short for the chat template ({len(head) + len(tail)} tokens)"
        )
    return room


def _template_around(tokenizer, generation_header: bool) -> tuple[list[int], list[int]]:
    """The ids the chat template puts before and after a single user message; on a model
    without a chat template (a base model, such as Gemma 3 270M), the special tokens its
    tokenizer puts around raw text, as `encode_prompt` sends it (Gemma's `<bos>`)."""
    if not getattr(tokenizer, "chat_template", None):
        plain = tokenizer("x", add_special_tokens=False)["input_ids"]
        marked = list(tokenizer("x", add_special_tokens=True)["input_ids"])
        for start in range(len(marked) - len(plain) + 1):
            if marked[start : start + len(plain)] == plain:
                return marked[:start], marked[start + len(plain) :]
        raise UserError("the tokenizer splits text differently with its special tokens")
    marker = "\u0000"
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}],
        tokenize=False,
        add_generation_prompt=generation_header,
    )
    before, _, after = templated.partition(marker)
    head = tokenizer(before, add_special_tokens=False)["input_ids"]
    tail = tokenizer(after, add_special_tokens=False)["input_ids"]
    return list(head), list(tail)


class TextSource:
    """Passages of one split's essay text from random sentences. The sentences' token counts
    are computed once, for building many passages (training data)."""

    def __init__(self, tokenizer, split: str = "train"):
        self.tokenizer = tokenizer
        self.pool = sentence_pool(split=split)
        encoded = tokenizer([" " + s for s in self.pool], add_special_tokens=False)
        self.lengths = [len(ids) for ids in encoded["input_ids"]]

    def tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def text(self, rng: random.Random, tokens: int) -> str:
        """Whole sentences totalling at most about `tokens` tokens (at least one sentence)."""
        start = rng.randrange(len(self.pool))
        return take_sentences(self.pool, tokens, start, self.lengths.__getitem__)
