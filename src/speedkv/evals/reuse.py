"""The `reuse` task: one document, four questions about facts planted in it, each asked twice.

- reused: the document is prefilled once (`Engine.prefill`, a user message of its own) and
  every question continues that one cache as the next user message
  (`Engine.continuation`), so only the question's tokens are prefilled;
- fresh: the same conversation (document message, question message) prefilled from nothing.

Both prompts are the same token ids, so for full attention the answers must agree; for SPEED
they agree unless where a token was computed changes the answer (reused, the document's own
deep suffix was computed when it was cached; fresh, the question's alone). A method whose
cache depends on the question (SnapKV, FastKV, SpecPrefill, ...) refuses reuse: its fresh
answers are recorded and its reused ones carry the engine's refusal.

The four facts are of different kinds (a number, a city, a name, a date), planted at four
spread depths in an order drawn per document; scoring is `needles.found_values`.
"""

from __future__ import annotations

import calendar
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from speedkv.core.engine import Engine, Request
from speedkv.core.policy import Policy
from speedkv.core.sampling import SamplingParams
from speedkv.errors import UserError
from speedkv.evals.documents import Fact, document_turn, fit_message, minimum_length, plant_all
from speedkv.evals.needles import INTRO_MANY, found_values, sample_rng
from speedkv.evals.render import cell, percent, percent_or_refused
from speedkv.evals.task import (
    Column,
    EvalConfig,
    Services,
    Table,
    Task,
    Timing,
    Unit,
    base_record,
)
from speedkv.hf.text import EncodedPrompt, encode_messages
from speedkv.prompts.builders import QUESTION_ROOM
from speedkv.prompts.haystack import sentence_count

TASK = "reuse"
MAX_NEW_TOKENS = 40
FACT_DEPTHS = (0.1, 0.37, 0.63, 0.9)  # one fact at each; which fact where is drawn per document

NAMES = (
    "Ingrid", "Tomas", "Yara", "Felix", "Nadia", "Oscar",
    "Leila", "Bruno", "Hana", "Marco", "Sofia", "Viktor",
)  # fmt: skip
CITIES = (
    "Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Dublin",
    "Quito", "Tallinn", "Perth", "Seville", "Krakow", "Montreal",
)  # fmt: skip
DOG_NAMES = (
    "Biscuit", "Pepper", "Maple", "Ziggy", "Nugget", "Clover",
    "Waffles", "Juniper", "Pickle", "Rocket", "Mochi", "Tofu",
)  # fmt: skip
EVENTS = (
    "harvest fair", "chess final", "school play", "river race",
    "book swap", "film night", "choir concert", "kite festival",
)  # fmt: skip


@dataclass(frozen=True)
class Question:
    kind: str
    fact: str  # the planted sentence
    text: str  # the question asked
    expected: list[str]  # every value the answer must contain


@dataclass(frozen=True)
class Kind:
    """One kind of fact: templates over `{name}` (a person) and the values `draw` makes;
    the answer must contain every value named in `answer`."""

    name: str
    fact: str
    question: str
    draw: Callable[[random.Random], dict[str, str]]
    answer: tuple[str, ...]

    def make(self, rng: random.Random, person: str) -> Question:
        values = {"name": person, **self.draw(rng)}
        return Question(
            self.name,
            self.fact.format(**values),
            self.question.format(**values),
            [values[key] for key in self.answer],
        )


def _date(rng: random.Random) -> dict[str, str]:
    event, month = rng.choice(EVENTS), rng.choice(calendar.month_name[1:])
    return {"event": event, "month": month, "day": str(rng.randint(2, 28))}


KINDS = (
    Kind(
        "number",
        "The pass key is {key}. Remember it. {key} is the pass key.",
        "What is the pass key? Answer with the number only.",
        lambda rng: {"key": str(rng.randrange(10000, 100000))},
        ("key",),
    ),
    Kind(
        "city",
        "{name} lives in the city of {city}. Remember it. {name}'s home is {city}.",
        "In which city does {name} live? Answer with the city only.",
        lambda rng: {"city": rng.choice(CITIES)},
        ("city",),
    ),
    Kind(
        "name",
        "{name} has a dog named {dog}. Remember it. {dog} is {name}'s dog.",
        "What is the name of {name}'s dog? Answer with the name only.",
        lambda rng: {"dog": rng.choice(DOG_NAMES)},
        ("dog",),
    ),
    Kind(
        "date",
        "The {event} will be held on {month} {day}. Remember it. The {event} is on {month} {day}.",
        "On what date will the {event} be held? Answer with the date only.",
        _date,
        ("month", "day"),
    ),
)
QUESTIONS = len(KINDS)


@dataclass
class Quiz:
    """One document with its planted facts, and the questions about them (in kind order)."""

    index: int
    start: int  # haystack sentence offset in the split
    document: str  # the user message that is cached
    prompt: EncodedPrompt  # the document's tokens: template, message, end of turn; no header
    questions: list[Question]
    depths: list[float]  # each question's fact depth


def _plan(rng: random.Random) -> tuple[list[Question], list[float]]:
    people = rng.sample(NAMES, QUESTIONS)
    questions = [kind.make(rng, person) for kind, person in zip(KINDS, people)]
    depths = list(FACT_DEPTHS)
    rng.shuffle(depths)
    return questions, depths


def _render(questions: list[Question], depths: list[float]) -> Callable[[str], str]:
    facts = [Fact(q.fact, d) for q, d in zip(questions, depths)]
    return lambda haystack: f"{INTRO_MANY}\n\n{plant_all(haystack, facts)}"


def build_quiz(tokenizer, length: int, index: int, seed: int, split: str = "eval") -> Quiz:
    """Document `index` at `length` tokens (its chat turn, without a question); all randomness
    from `seed`, so the same index plants the same facts at every length."""
    rng = sample_rng(seed, TASK, index)
    start = rng.randrange(sentence_count(split))
    questions, depths = _plan(rng)
    render = _render(questions, depths)
    document, prompt = fit_message(
        tokenizer, length, render, split, start, TASK, document_turn(tokenizer)
    )
    return Quiz(index, start, document, prompt, questions, depths)


def shortest_document(tokenizer) -> int:
    """Tokens a document takes with its facts and no essay text."""
    questions, depths = _plan(sample_rng(0, TASK, 0))
    return minimum_length(tokenizer, _render(questions, depths), document_turn(tokenizer))


def fresh_prompt(tokenizer, quiz: Quiz, question: Question) -> EncodedPrompt:
    """The whole conversation, document message then question message, as one prompt."""
    messages = [
        {"role": "user", "content": quiz.document},
        {"role": "user", "content": question.text},
    ]
    return encode_messages(tokenizer, messages)


def ask(engine: Engine, policy: Policy, quiz: Quiz, new_tokens: int = MAX_NEW_TOKENS) -> list[dict]:
    """One record per question: the fresh answer, and the answer over the cached document
    (or the engine's refusal when `policy` cannot reuse a cache)."""
    sampling = SamplingParams(max_new_tokens=new_tokens)
    cached, refusal = None, None
    try:
        cached = engine.prefill(quiz.document, policy.fresh())
    except UserError as err:
        refusal = str(err)
    records = []
    for number, question in enumerate(quiz.questions):
        prompt = fresh_prompt(engine.tokenizer, quiz, question)
        fresh = engine.generate(
            [Request(prompt.ids, policy, sampling, prompt.header_tokens, prompt.turn_tokens)]
        )[0]
        record = {
            "question": number,
            "kind": question.kind,
            "depth": quiz.depths[number],
            "start": quiz.start,
            "prompt_tokens": len(prompt.ids),
            "document_tokens": len(quiz.prompt.ids),
            "expected": question.expected,
            "asked": question.text,
            "fact": question.fact,
            **_answer("fresh", fresh.text, question.expected),
            "fresh_ttft_s": fresh.ttft_s,
        }
        if cached is None:
            record.update(refused=refusal, reused_answer=None, reused_correct=None, identical=None)
        else:
            request = engine.continuation(cached, question.text, sampling)
            if request.ids != prompt.ids:  # the comparison is only fair on the same tokens
                raise RuntimeError("the reused prompt differs from the fresh one")
            reused = engine.generate([request])[0]
            record.update(
                refused=None,
                **_answer("reused", reused.text, question.expected),
                identical=reused.output_ids == fresh.output_ids,
                reused_tokens=reused.reused_tokens,
                reused_ttft_s=reused.ttft_s,
                document_prefill_s=cached.ttft_s,
            )
        records.append(record)
    return records


def _answer(mode: str, text: str, expected: list[str]) -> dict:
    found = found_values(text, expected)
    return {
        f"{mode}_answer": text,
        f"{mode}_found": found,
        f"{mode}_correct": len(found) == len(expected),
    }


# -- the task -----------------------------------------------------------------------------------
class ReuseTask(Task):
    """A method's records for one document come together, one per question: each asked fresh
    and over the cached document."""

    name = TASK
    description = "four planted facts, each asked over one cached document and with a fresh prefill"
    default_samples = 8  # documents; each asks QUESTIONS questions
    max_new_tokens = MAX_NEW_TOKENS
    records_per_run = QUESTIONS
    tables_shown = (
        Table(
            "accuracy, each question with a fresh prefill of document + question",
            "fresh",
            percent,
        ),
        Table("accuracy, every question over one cached document", "reused", percent_or_refused),
        Table(
            "answers token for token the same, reused against fresh",
            "identical",
            percent_or_refused,
        ),
    )
    headline = Column("reused", "reused")

    def validate(self, ctx: Services, length: int) -> None:
        needed = 2 * shortest_document(ctx.model.tokenizer)
        if length < needed:
            raise UserError(
                f"length {length} is too short for task {self.name}: it needs at least "
                f"{needed} tokens (half of them essay text)"
            )
        # the question's turn comes on top of the document's length
        self.check_room(ctx, length, QUESTION_ROOM + self.max_new_tokens)

    def run(
        self, ctx: Services, unit: Unit, methods: list[str], records: list[dict]
    ) -> Iterator[dict]:
        cfg = ctx.config
        quiz = build_quiz(ctx.model.tokenizer, unit.length, unit.index, cfg.seed, cfg.split)
        for method in methods:
            t0 = time.perf_counter()
            answers = ask(ctx.engine, ctx.policies[method], quiz, self.max_new_tokens)
            seconds = (time.perf_counter() - t0) / len(answers)
            for answer in answers:
                prompt_tokens = answer.pop("prompt_tokens")
                yield {
                    **base_record(method, unit, prompt_tokens),
                    **answer,
                    "score": float(answer["fresh_correct"]),  # reused: `reused_correct`
                    "seconds": seconds,
                }

    def estimate_seconds(
        self, unit: Unit, methods: list[str], config: EvalConfig, timing: Timing
    ) -> float:
        # the document's prefill and one per question, each question answered twice
        per = timing.run_seconds(unit.length, self.max_new_tokens, QUESTIONS + 1, 2 * QUESTIONS)
        return len(methods) * per

    def summarise(self, records: list[dict]) -> dict:
        return {
            **summary(records),
            "by_kind": {
                kind: summary([r for r in records if r["kind"] == kind])
                for kind in dict.fromkeys(r["kind"] for r in records)
            },
        }

    def miss(self, record: dict) -> tuple[list[str], str] | None:
        if record["fresh_correct"] and record["reused_correct"] is not False:
            return None
        reused = "refuses" if record["refused"] else cell(record["reused_answer"])
        return record["expected"], f"fresh: {cell(record['fresh_answer'])}; reused: {reused}"


def summary(records: list[dict]) -> dict:
    """Accuracy fresh and reused, and how often the two answers are the same tokens; None
    for what a method that refuses reuse does not have (or for no records)."""
    reused = [r for r in records if r["refused"] is None]
    return {
        "fresh": statistics.fmean(r["fresh_correct"] for r in records) if records else None,
        "reused": statistics.fmean(r["reused_correct"] for r in reused) if reused else None,
        "identical": statistics.fmean(r["identical"] for r in reused) if reused else None,
        "documents": len({r["sample"] for r in records}),
    }


REUSE = ReuseTask()
