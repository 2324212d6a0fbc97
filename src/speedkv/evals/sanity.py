"""Short-prompt sanity: fixed short instructions, each method's greedy answer against full's.

SPEED makes prompt tokens shallow whatever the prompt's length, so a short chat prompt is
affected too; these prompts show whether a method changes everyday answers. Score: the share
of prompts whose answer is token for token the same as full's; also reported, the position-
wise agreement over the first `AGREEMENT_TOKENS` tokens. The `calib` split has prompts of its
own, for choosing settings without looking at the ones that measure them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator

from speedkv.core.engine import Request
from speedkv.core.sampling import SamplingParams
from speedkv.evals.render import SHORT, percent
from speedkv.evals.task import (
    FULL,
    Column,
    EvalConfig,
    Services,
    Table,
    Task,
    Timing,
    Unit,
    base_record,
    record_key,
)
from speedkv.hf.text import encode_prompt

PROMPTS = (
    "What is 17 + 25? Answer with the number only.",
    "What is 9 times 8? Answer with the number only.",
    "List three primary colors, separated by commas.",
    "Name the days of the week, starting with Monday.",
    "Define the word 'photosynthesis' in one sentence.",
    "What is the capital of France?",
    "Rewrite this sentence in the past tense: She walks to the market.",
    "Translate 'good morning' into Spanish.",
    "Give one synonym for the word 'happy'.",
    "Sort these numbers from smallest to largest: 42, 7, 19, 3.",
    "Write the opposite of 'ancient'.",
    "Complete the sequence: 2, 4, 6, 8, ...",
)
# Design-time prompts (`--split calib`): never used to measure a method.
CALIB_PROMPTS = (
    "What is 12 minus 5? Answer with the number only.",
    "Name two animals that live in the ocean.",
    "What color is the sky on a clear day?",
    "Spell the word 'banana' backwards.",
    "Which planet is closest to the sun?",
    "Give an antonym for 'generous'.",
    "Convert 3 hours into minutes. Answer with the number only.",
    "What is the plural of 'mouse'?",
    "Write a short greeting for a birthday card.",
    "Translate 'thank you' into French.",
    "What is the largest mammal?",
    "Name the four seasons of the year.",
    "How many legs does a spider have?",
    "Put these words in alphabetical order: pear, apple, mango.",
    "What is the square root of 81?",
    "Write a Python expression that adds 2 and 3.",
)
MAX_NEW_TOKENS = 48
AGREEMENT_TOKENS = 32


def prompts(split: str = "eval") -> tuple[str, ...]:
    """The prompt set of a split (`eval` measures, `calib` designs; a corpus prefix such as
    `pydocs:` names haystack text only)."""
    return CALIB_PROMPTS if split.rpartition(":")[2] == "calib" else PROMPTS


def token_agreement(ours: list[int], reference: list[int], window: int = AGREEMENT_TOKENS) -> float:
    """Share of the first positions (up to `window`, as far as the longer answer goes) at
    which both answers have the same token."""
    span = min(window, max(len(ours), len(reference)))
    if span == 0:
        return 1.0
    same = sum(1 for a, b in zip(ours[:span], reference[:span]) if a == b)
    return same / span


# -- the task -----------------------------------------------------------------------------------
class SanityTask(Task):
    """Each prompt once per method, its greedy answer against full's (the reference model's
    with --reference); prompts have their own lengths, recorded as length 0."""

    name = "sanity"
    description = "short instructions: greedy answer identical to full's"
    default_samples = len(PROMPTS)
    max_new_tokens = MAX_NEW_TOKENS
    uses_lengths = False
    methodology = """\
**sanity**: twelve fixed short instructions (arithmetic, lists, definitions, rewriting,
translation); a method scores when its greedy answer (up to 48 tokens) is token for token
full's. Full is the reference, so it scores 100% by construction. Its rows carry length 0
in `results.json`.
"""
    tables_shown = (
        Table("answers identical to full's", "score", percent),
        Table(
            f"token agreement with full, first {AGREEMENT_TOKENS} tokens",
            "token_agreement",
            "{:.3f}".format,
        ),
    )
    headline = Column("score", "sanity")
    compared = (
        Column("score", "sanity"),
        Column("token_agreement", "sanity agr.", "{:.3f}".format),
    )

    def validate(self, ctx: Services, length: int) -> None:
        pass  # its prompts do not take --lengths

    def units(self, config: EvalConfig) -> list[Unit]:
        count = min(config.n[self.name], len(prompts(config.split)))
        return [Unit(self.name, SHORT, i) for i in range(count)]

    def run(
        self, ctx: Services, unit: Unit, methods: list[str], records: list[dict]
    ) -> Iterator[dict]:
        prompt = prompts(ctx.config.split)[unit.index]
        encoded = encode_prompt(ctx.model.tokenizer, prompt)
        own_reference = ctx.reference_engine is ctx.engine
        if own_reference:
            reference = next(
                (r for r in records if record_key(r) == (FULL, unit.task, unit.length, unit.index)),
                None,
            )
        else:  # the reference model's greedy answer, made again on every resume (it is short)
            request = Request(
                encoded.ids, ctx.reference_full, SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
            )
            g = ctx.reference_engine.generate([request])[0]
            reference = {"output_ids": g.output_ids, "answer": g.text}
        for method in methods:
            t0 = time.perf_counter()
            g = ctx.generate(method, encoded, MAX_NEW_TOKENS)
            mine = method == FULL and own_reference
            full_ids = g.output_ids if mine else reference["output_ids"]
            full_text = g.text if mine else reference["answer"]
            record = {
                **base_record(method, unit, len(encoded.ids)),
                "prompt": prompt,
                "answer": g.text,
                "full_answer": full_text,
                "exact": g.output_ids == full_ids,
                "score": float(g.output_ids == full_ids),
                "token_agreement": token_agreement(g.output_ids, full_ids),
                "output_ids": g.output_ids,
                "finish_reason": g.finish_reason,
                "seconds": time.perf_counter() - t0,
            }
            if mine:
                reference = record
            yield record

    def estimate_seconds(
        self, unit: Unit, methods: list[str], config: EvalConfig, timing: Timing
    ) -> float:
        return len(methods) * timing.run_seconds(64, self.max_new_tokens)  # prompts are short

    def summarise(self, records: list[dict]) -> dict:
        agreement = [r["token_agreement"] for r in records]
        return {"token_agreement": statistics.fmean(agreement) if agreement else None}


SANITY = SanityTask()
