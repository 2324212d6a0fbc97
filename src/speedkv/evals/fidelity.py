"""Fidelity: how much a method changes the model's next-token distributions.

The prompt is the first P tokens of an essay passage (raw text with the tokenizer's own
special tokens, no chat template: the continuation is the essay itself); the next K tokens
of the same passage are teacher-forced through the method's real decode path
(`Engine.decode_step`), one at a time at their true positions. At each of the K positions we
take the method's log-probabilities and compare them with `full`'s on the same tokens:

- NLL of the true next token (mean over positions) and perplexity exp(NLL),
- top-1 agreement: the method's argmax equals full's,
- KL(full || method), in nats, mean over positions.

`full` compared with itself gives agreement 1, KL 0 and perplexity ratio 1 exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from speedkv.core.engine import Engine
from speedkv.core.policy import Policy
from speedkv.prompts.builders import raw_passage
from speedkv.prompts.haystack import sentence_count

DEFAULT_TOKENS = 64


@dataclass
class FidelitySample:
    index: int
    start: int  # passage sentence offset in the split
    prompt: list[int]
    continuation: list[int]


def build_sample(
    tokenizer, length: int, tokens: int, index: int, seed: int, split: str = "eval"
) -> FidelitySample:
    """Sample `index`: a passage starting at a seeded sentence offset (the same at every
    length), cut into a `length`-token prompt and the `tokens` that follow it."""
    rng = random.Random(f"{seed}/fidelity/{index}")
    start = rng.randrange(sentence_count(split))
    ids = raw_passage(tokenizer, length + tokens, split, start)
    return FidelitySample(index, start, ids[:length], ids[length:])


@torch.inference_mode()
def teacher_forced_logprobs(
    engine: Engine, prompt: list[int], continuation: list[int], policy: Policy
) -> torch.Tensor:
    """Log-probabilities [K, vocab] (float32) the method assigns at each continuation
    position: row i predicts continuation[i], given the prompt and continuation[:i]."""
    done = engine.prefill_ids(prompt, policy, spare=len(continuation))
    rows = [done.logits]
    for i, token in enumerate(continuation[:-1]):
        position = done.next_position + i
        rows.append(engine.decode_step([done.cache], [policy], [token], [position])[0])
    return torch.log_softmax(torch.stack(rows).float().cpu(), dim=-1)


def compare(method: torch.Tensor, full: torch.Tensor, continuation: list[int]) -> dict:
    """Per-sample fidelity of `method` log-probs against `full`'s, both [K, vocab]."""
    target = torch.tensor(continuation)[:, None]
    nll = -method.gather(1, target)[:, 0]
    nll_full = -full.gather(1, target)[:, 0]
    top1, top1_full = method.argmax(-1), full.argmax(-1)
    kl = (full.exp() * (full - method)).sum(-1)
    return {
        "nll": float(nll.mean()),
        "nll_full": float(nll_full.mean()),
        "agreement": float((top1 == top1_full).float().mean()),
        "kl": float(kl.mean()),
        "top1_text": float((top1 == target[:, 0]).float().mean()),
        "first_disagreement": first_false((top1 == top1_full).tolist()),
    }


def first_false(flags: list[bool]) -> int | None:
    """Index of the first position where the method's top-1 differs from full's."""
    return next((i for i, same in enumerate(flags) if not same), None)
