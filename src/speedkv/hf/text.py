"""Text in and out: chat-template encoding, incremental detokenisation, stop strings."""

from __future__ import annotations

from dataclasses import dataclass

from speedkv.errors import UserError


@dataclass
class EncodedPrompt:
    ids: list[int]
    header_tokens: int | None  # tokens of the generation header the template appends (chat only)


def encode_prompt(
    tokenizer, text: str, chat: bool = True, system: str | None = None
) -> EncodedPrompt:
    """Token ids of a prompt: through the chat template by default, or raw text."""
    if not text or not text.strip():
        raise UserError("the prompt is empty; give some text or a --prompt-file")
    if not chat or not getattr(tokenizer, "chat_template", None):
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        return EncodedPrompt(list(ids), None)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    return encode_messages(tokenizer, messages)


def encode_messages(tokenizer, messages: list[dict]) -> EncodedPrompt:
    """Token ids of a chat conversation ending with the assistant's generation header."""
    with_header = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    ids = tokenizer(with_header, add_special_tokens=False)["input_ids"]
    header = None
    if with_header.startswith(without) and len(with_header) > len(without):
        header = len(tokenizer(with_header[len(without) :], add_special_tokens=False)["input_ids"])
    return EncodedPrompt(list(ids), header)


def eos_token_ids(tokenizer, hf_config=None, generation_config=None) -> set[int]:
    """Every id that ends generation: the tokenizer's EOS and the model's configured ones."""
    ids: set[int] = set()
    for source in (tokenizer, hf_config, generation_config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


class Detokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete characters."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return ""
        delta = text[len(self.text) :] if text.startswith(self.text) else text
        self.text = text
        return delta


def find_stop(text: str, stops: tuple[str, ...], new_from: int) -> int | None:
    """Index where the earliest stop string starts, looking only at matches that end after
    `new_from` (so earlier text is not searched again); None if there is none."""
    best = None
    for stop in stops:
        at = text.find(stop, max(0, new_from - len(stop) + 1))
        if at >= 0 and (best is None or at < best):
            best = at
    return best
