"""Choosing the next token: greedy, or temperature / top-k / top-p sampling with a seed, after
transformers' repetition penalty and min_new_tokens rules; and the mapping from the keyword
arguments of transformers' `generate` to our parameters."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from speedkv.errors import UserError


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0  # EOS is masked until this many new tokens exist
    repetition_penalty: float = 1.0  # transformers' rule over prompt and output ids; 1 = off

    @classmethod
    def from_generate_args(cls, **kwargs: Any) -> SamplingParams:
        """Parameters from transformers `generate`-style keyword arguments, with their HF
        meaning; our own names (stop, seed, ignore_eos) are accepted too. A None value means
        unset, as in HF. The model's generation_config is not consulted.

        do_sample=False     greedy, whatever temperature / top_k / top_p say
        do_sample=True      samples: temperature defaults to 1.0 and top_k to 50 (HF's
                            defaults); temperature must be above 0
        do_sample omitted   temperature decides (default 0 = greedy; above 0 samples), and
                            top_k defaults to 0 (no cut): our own convention, as before
        stop_strings        the same as stop (a string or a list of strings)
        """
        unknown = sorted(set(kwargs) - set(GENERATE_ARGUMENTS))
        if unknown:
            raise UserError(
                f"unknown sampling argument(s) {', '.join(unknown)}; accepted: "
                f"{', '.join(GENERATE_ARGUMENTS)}"
            )
        args = {key: value for key, value in kwargs.items() if value is not None}
        do_sample = args.pop("do_sample", None)
        if "stop_strings" in args:
            if "stop" in args:
                raise UserError("give stop or stop_strings (the same thing), not both")
            args["stop"] = args.pop("stop_strings")
        if "stop" in args:
            stop = args["stop"]
            args["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        if do_sample is False:
            args["temperature"] = 0.0
        elif do_sample is True:
            args.setdefault("temperature", 1.0)
            args.setdefault("top_k", 50)
            if args["temperature"] <= 0:
                raise UserError(
                    f"do_sample=True needs a temperature above 0, got {args['temperature']}; "
                    "use do_sample=False for greedy decoding"
                )
        return cls(**args).validate()

    def validate(self) -> SamplingParams:
        if self.max_new_tokens < 1:
            raise UserError(f"max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise UserError(f"temperature must be between 0 and 100, got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"top-k must be 0 (off) or a positive count, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top-p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise UserError("stop strings must not be empty")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise UserError(
                f"min-new-tokens must be between 0 and max-new-tokens ({self.max_new_tokens}), "
                f"got {self.min_new_tokens}"
            )
        if not self.repetition_penalty > 0:
            raise UserError(
                f"repetition-penalty must be above 0 (1 = off), got {self.repetition_penalty}"
            )
        return self

    @property
    def greedy(self) -> bool:
        # temperatures this small divide logits into overflow; they mean greedy anyway
        return self.temperature < 1e-5


# what `SamplingParams.from_generate_args` (and so `Engine.generate_text`) accepts
GENERATE_ARGUMENTS = (
    "max_new_tokens",
    "min_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "stop_strings",
    "stop",
    "seed",
    "ignore_eos",
)


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' repetition penalty: the logit of every seen token (bool [vocab]) is
    divided by `penalty` if positive and multiplied by it if negative."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


class Sampler:
    """Per-sequence sampler: its own generator, so a batch samples exactly like one-by-one runs.

    Call it once per new token of its sequence, in order: it remembers what it chose, for the
    repetition penalty (over `prompt_ids` and the output) and for min_new_tokens (which masks
    `eos_ids` until that many tokens were chosen)."""

    def __init__(
        self, params: SamplingParams, prompt_ids: Sequence[int] = (), eos_ids: Iterable[int] = ()
    ):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self.prompt_ids = prompt_ids
        self.eos_ids = sorted(eos_ids)
        self.chosen = 0
        self.seen: torch.Tensor | None = None  # bool [vocab], built at the first call

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [vocab] float32 on any device -> chosen token id."""
        token = self.choose(self.processed(logits))
        self.chosen += 1
        if self.seen is not None:
            self.seen[token] = True
        return token

    def processed(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits after the penalty and min_new_tokens rules (unchanged at their defaults)."""
        p = self.params
        if p.repetition_penalty != 1.0:
            logits = penalize_repeats(logits.float(), self.seen_mask(logits), p.repetition_penalty)
        if self.chosen < p.min_new_tokens and self.eos_ids:
            logits = logits.index_fill(0, in_vocab(self.eos_ids, logits), float("-inf"))
        return logits

    def seen_mask(self, logits: torch.Tensor) -> torch.Tensor:
        if self.seen is None:
            self.seen = torch.zeros(logits.numel(), dtype=torch.bool, device=logits.device)
            self.seen[in_vocab(self.prompt_ids, logits)] = True
        return self.seen

    def choose(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits.float().cpu() / p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            ordered, order = torch.sort(logits, descending=True)
            cumulative = torch.softmax(ordered, -1).cumsum(-1)
            # drop a token once the mass before it already reaches top_p (keep at least one)
            drop = (cumulative - torch.softmax(ordered, -1)) >= p.top_p
            drop[0] = False  # the likeliest token always stays, however small top_p is
            logits = logits.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(logits, -1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def in_vocab(ids: Iterable[int], logits: torch.Tensor) -> torch.Tensor:
    """`ids` as an index tensor for `logits`, without ids the head cannot produce (a tokenizer
    may know more ids than the model has rows)."""
    index = torch.as_tensor(list(ids), dtype=torch.long, device=logits.device)
    return index[index < logits.numel()]
