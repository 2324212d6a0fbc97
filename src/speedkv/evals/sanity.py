"""Short-prompt sanity: fixed short instructions, each method's greedy answer against full's.

SPEED makes prompt tokens shallow whatever the prompt's length, so a short chat prompt is
affected too; these prompts show whether a method changes everyday answers. Score: the share
of prompts whose answer is token for token the same as full's; also reported, the position-
wise agreement over the first `AGREEMENT_TOKENS` tokens. The `calib` split has prompts of its
own, for choosing settings without looking at the ones that measure them.
"""

from __future__ import annotations

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
