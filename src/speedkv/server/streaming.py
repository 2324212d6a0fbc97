"""OpenAI response bodies: whole completions and the SSE chunks of a stream."""

from __future__ import annotations

import json
import time
import uuid

from speedkv.core.engine import Generation


def sse(data: dict | str) -> str:
    """One server-sent event: `data: JSON` (or the literal `[DONE]`) and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


def usage(prompt_tokens: int, generations: list[Generation], choices: int) -> dict:
    """OpenAI's `usage` of a response whose generations are `choices` per prompt, in prompt
    order. A prompt's cached tokens are the fewest any of its choices took from the prefix
    cache: its later choices reuse the first one's prompt, which says nothing about the
    client's earlier requests."""
    completion = sum(len(g.output_ids) for g in generations)
    cached = sum(
        min(g.reused_tokens for g in generations[at : at + choices])
        for at in range(0, len(generations), choices)
    )
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def stats(generation: Generation) -> dict:
    """What the engine measured for one choice (the extra field `speedkv`)."""
    return {
        "method": generation.method,
        "ttft_s": generation.ttft_s,
        "tpot_s": generation.tpot_s,
        "kv_bytes": generation.kv_bytes,
        "kv_bytes_final": generation.kv_bytes_final,
        "reused_tokens": generation.reused_tokens,
    }


class Formatter:
    """Bodies of one response, chat (`chat.completion`) or text (`text_completion`), whose
    generations are `choices` per prompt."""

    def __init__(self, chat: bool, model: str, choices: int):
        self.chat = chat
        self.model = model
        self.choices = choices
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, object_: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": object_,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    # -- non-streaming ---------------------------------------------------------------------
    def complete(self, texts: list[str], generations: list[Generation], prompt_tokens: int) -> dict:
        if self.chat:
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": g.finish_reason,
                }
                for i, (text, g) in enumerate(zip(texts, generations))
            ]
        else:
            choices = [
                {"index": i, "text": text, "logprobs": None, "finish_reason": g.finish_reason}
                for i, (text, g) in enumerate(zip(texts, generations))
            ]
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage(prompt_tokens, generations, self.choices)
        body["speedkv"] = [stats(g) for g in generations]
        return body

    # -- streaming -------------------------------------------------------------------------
    def _chunk(self, index: int, content: dict | str, finish_reason: str | None) -> dict:
        if self.chat:
            choice = {"index": index, "delta": content, "logprobs": None}
            object_ = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": content, "logprobs": None}
            object_ = "text_completion"
        choice["finish_reason"] = finish_reason
        return self._envelope(object_, [choice])

    def opening(self, index: int) -> dict | None:
        """Chat streams announce the role first; text streams have no opening chunk."""
        if not self.chat:
            return None
        return self._chunk(index, {"role": "assistant", "content": ""}, None)

    def delta(self, index: int, text: str) -> dict:
        return self._chunk(index, {"content": text} if self.chat else text, None)

    def finish(self, index: int, generation: Generation) -> dict:
        chunk = self._chunk(index, {} if self.chat else "", generation.finish_reason)
        chunk["speedkv"] = stats(generation)
        return chunk

    def usage_chunk(self, prompt_tokens: int, generations: list[Generation]) -> dict:
        chunk = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        chunk["usage"] = usage(prompt_tokens, generations, self.choices)
        return chunk
