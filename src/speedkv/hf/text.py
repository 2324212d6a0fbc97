"""Text in and out: chat-template encoding, incremental detokenisation, stop strings."""

from __future__ import annotations

from dataclasses import dataclass

from speedkv.errors import UserError


@dataclass
class EncodedPrompt:
    ids: list[int]
    header_tokens: int | None  # tokens of the generation header the template appends (chat only)
    turn_tokens: int | None = None  # the last message's content, its end and the header (chat)


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


def starts_with_bos(tokenizer) -> bool:
    """Whether the model's prompts begin with its BoS token: the chat template's first token
    (raw text's, without a template) is the tokenizer's `bos_token_id`. SmolLM2's ChatML
    prompts do (its BoS is `<|im_start|>`); Qwen2.5's do not (its BoS, `<|endoftext|>`, is never
    added). Without a tokenizer the caller's ids are taken on trust: True."""
    if tokenizer is None:
        return True
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    if getattr(tokenizer, "chat_template", None):
        ids = encode_messages(tokenizer, [{"role": "user", "content": "x"}]).ids
    else:
        ids = tokenizer("x", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == bos


TURN_MARK = "\u0001speedkv-turn\u0001"  # stands in for the last message to find where it starts


def encode_messages(
    tokenizer, messages: list[dict], generation_header: bool = True
) -> EncodedPrompt:
    """Token ids of a chat conversation, ending with the assistant's generation header (or,
    with generation_header=False, with the last message: a document to cache and continue)."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_header
    )
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    header = None
    if generation_header:
        without = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False
        )
        if text.startswith(without) and len(text) > len(without):
            tail = text[len(without) :]
            header = len(tokenizer(tail, add_special_tokens=False)["input_ids"])
    # a document cached without a question has no turn to keep deep
    turn = _turn_tokens(tokenizer, messages, text, ids) if generation_header else None
    return EncodedPrompt(ids, header, turn)


def encode_with_reply(tokenizer, messages: list[dict], reply: str) -> EncodedPrompt:
    """A chat prompt whose assistant reply already begins with `reply` (a benchmark's answer
    prefix, such as RULER's): the generation header, then `reply`. The reply's tokens count
    with the header and the last turn, since they are the answer's first tokens (`deep=header`
    keeps them deep)."""
    prompt = encode_messages(tokenizer, messages)
    if not reply:
        return prompt
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = list(tokenizer(text + reply, add_special_tokens=False)["input_ids"])
    if ids[: len(prompt.ids)] != prompt.ids:
        raise ValueError("the reply merges with the chat template's last tokens")
    extra = len(ids) - len(prompt.ids)
    header = None if prompt.header_tokens is None else prompt.header_tokens + extra
    turn = None if prompt.turn_tokens is None else prompt.turn_tokens + extra
    return EncodedPrompt(ids, header, turn)


def _turn_tokens(tokenizer, messages: list[dict], text: str, ids: list[int]) -> int | None:
    """Tokens from the start of the last message's content to the end: the template is
    rendered with a marker for that content, and what precedes the marker must tokenize to a
    prefix of `ids` (else the turn has no token boundary, and None says so)."""
    marked = [*messages[:-1], {**messages[-1], "content": TURN_MARK}]
    rendered = tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=False)
    before, found, _ = rendered.partition(TURN_MARK)
    if not found or not text.startswith(before):
        return None
    head = tokenizer(before, add_special_tokens=False)["input_ids"]
    if ids[: len(head)] != list(head):
        return None
    return len(ids) - len(head)


def content_prefix_tokens(tokenizer, messages: list[dict], chars: int, ids: list[int]) -> int:
    """How many of `ids` (the conversation encoded) come before character `chars` of the last
    message's content: the template up to that content, plus its first `chars` characters,
    tokenized alone must be a prefix of `ids` (else there is no token boundary there, and
    ValueError says so). Without a chat template, the content is the raw prompt."""
    content = messages[-1]["content"][:chars]
    if getattr(tokenizer, "chat_template", None):
        marked = [*messages[:-1], {**messages[-1], "content": TURN_MARK}]
        rendered = tokenizer.apply_chat_template(marked, tokenize=False)
        before = rendered.partition(TURN_MARK)[0]
        head = list(tokenizer(before + content, add_special_tokens=False)["input_ids"])
    else:
        head = list(tokenizer(content, add_special_tokens=True)["input_ids"])
    if ids[: len(head)] != head:
        raise ValueError("the text up to that character does not end on a token boundary")
    return len(head)


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
