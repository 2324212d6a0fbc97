"""The training corpus (Python's documentation) and the drills made from it."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from speedkv.errors import UserError
from speedkv.prompts.builders import TextSource
from speedkv.prompts.haystack import essays, parse_split, sentence_pool, sentences, split_names
from speedkv.prompts.pydocs import LONGEST_SENTENCE_CHARS, cut_long, python_docs
from speedkv.train.tasks import multiquery, toplist, wordfreq


@pytest.fixture(scope="module")
def source(smol_tokenizer) -> TextSource:
    return TextSource(smol_tokenizer, split="pydocs:train")


def test_pydocs_splits_partition_the_corpus_and_share_nothing_with_the_essays():
    docs = python_docs()
    assert len(docs) > 1000 and all(text and "\n" not in text for text in docs.values())
    parts = [set(split_names(f"pydocs:{name}")) for name in ("train", "eval", "calib")]
    assert set().union(*parts) == set(docs) and sum(map(len, parts)) == len(docs)
    pool = set(sentence_pool(split="pydocs:train"))
    assert not pool & set(sentence_pool(split="pydocs:eval"))
    essay_sentences = {s for text in essays().values() for s in sentences(text) if len(s) > 40}
    assert not pool & essay_sentences
    assert max(map(len, pool)) <= LONGEST_SENTENCE_CHARS


def test_split_names_parse_and_bad_names_fail():
    assert parse_split("eval") == ("essays", "eval")
    assert parse_split("pydocs:calib") == ("pydocs", "calib")
    with pytest.raises(UserError, match="unknown text corpus 'wiki'"):
        parse_split("wiki:eval")
    with pytest.raises(UserError, match="unknown text split 'test'"):
        parse_split("pydocs:test")


def test_long_runs_are_cut_at_spaces():
    text = " ".join(f"word{i}" for i in range(400))
    pieces = cut_long(text)
    assert " ".join(pieces) == text and all(len(p) <= LONGEST_SENTENCE_CHARS for p in pieces)
    assert cut_long("short.") == ["short."]


@pytest.mark.parametrize("drill", [wordfreq, toplist])
@pytest.mark.parametrize("seed", range(6))
def test_frequency_drills_name_the_most_frequent_words_in_order(source, seed, drill):
    record = drill(random.Random(seed), source, 900)
    prompt, answer = (m["content"] for m in record["messages"])
    body = prompt.split("\n\n")[1]
    words = [re.sub(r"^\d+\. ", "", item) for item in re.split(r"\n| ", body) if item]
    words = [w for w in words if not w.endswith(".") and not w.isdigit()]
    counts = Counter(words)
    named = answer.split(": ", 1)[1].rstrip(".").split(", ")
    top = int(re.search(r"The (\d+) most", answer).group(1))
    assert len(named) == top == len(set(named))
    named_counts = [counts[w] for w in named]
    assert named_counts == sorted(named_counts, reverse=True)
    assert len(set(named_counts)) == top  # no tie among them: the order is the answer
    others = [c for w, c in counts.items() if w not in named]
    assert others and min(named_counts) > max(others)


@pytest.mark.parametrize("seed", range(4))
def test_toplist_asks_for_ten_words_of_a_numbered_list_where_it_has_room(source, seed):
    record = toplist(random.Random(seed), source, 1900)
    prompt, answer = (m["content"] for m in record["messages"])
    lines = prompt.split("\n\n")[1].split("\n")
    assert [line.split(". ", 1)[0] for line in lines] == [str(i) for i in range(1, len(lines) + 1)]
    assert answer.startswith("The 10 most frequent words are: ")
    short = toplist(random.Random(seed), source, 500)["messages"][1]["content"]
    assert not short.startswith("The 10 ")  # ten would crowd out the other words


@pytest.mark.parametrize("seed", range(4))
def test_multiquery_answers_every_asked_key_from_the_text(source, seed):
    record = multiquery(random.Random(seed), source, 900)
    prompt, answer = (m["content"] for m in record["messages"])
    pairs = re.findall(r"The code for (\w+) is (\d+)\.", answer)
    assert len(pairs) >= 2
    for word, code in pairs:
        assert f"The code for {word} is {code}." in prompt and word in prompt.split("\n")[-1]
