"""`speedkv bench-reuse`: what a question about a cached document costs, against asking the
whole prompt from scratch.

Per repeat, length and method: one document (essay text, a user message of its own) is
prefilled once (`Engine.prefill`, its time is the document's prefill); then each question is
asked twice, back to back, on the same token ids: continuing the cached document (only the
question's turn is prefilled) and from scratch (document and question prefilled together).
Which of the two goes first alternates, methods rotate within a repeat (as in `speedkv bench`),
and every ratio is taken within one pair or one repeat. Raw runs go to `runs.jsonl` as they
finish, so `--resume` picks up where a sweep stopped.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from speedkv.bench.machine import machine_facts
from speedkv.bench.runner import append_runs, pending_runs, start_runs
from speedkv.core.engine import Engine, check_reusable
from speedkv.core.registry import MethodSpec, config_record, make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.errors import UserError
from speedkv.hf.loading import LoadedModel
from speedkv.prompts.builders import QUESTION_ROOM, chat_document

# Questions about an essay, each about 30 tokens as a chat turn (with the generation header).
QUESTIONS = (
    "According to the document, what does the author say about startups and how they should "
    "think about growth?",
    "Summarise in two sentences what the author believes is the most common mistake that "
    "founders make early on.",
    "Which examples does the author give to support the main argument, and do you find them "
    "convincing overall?",
    "What advice does the essay give to someone deciding whether to start a company or to "
    "take a regular job?",
    "How does the author describe the relationship between investors and founders in the "
    "text you just read?",
    "List the three ideas from the document that seem most surprising, and explain briefly "
    "why each one matters.",
)


@dataclass
class ReuseBenchConfig:
    model: str
    methods: list[MethodSpec | str]  # parsed specs, or their text; each must be reusable
    lengths: list[int]  # document tokens (the cached chat turn)
    questions: int = 3
    new_tokens: int = 4
    repeats: int = 3
    dtype: str = "auto"
    command: str = ""  # the command line that produced the results, for the report


class ReuseBench:
    def __init__(self, model: LoadedModel, config: ReuseBenchConfig, out: Path):
        self.model, self.config, self.out = model, config, out
        if model.tokenizer is None:
            raise UserError("bench-reuse needs a model with a tokenizer (questions are text)")
        self.engine = Engine(model)
        bound = [
            make_policy(m, model.shape, model.trained_method) for m in ["full", *config.methods]
        ]
        for policy in bound:
            check_reusable(policy)
        self.policies = {p.spec(): p for p in bound}  # full first: ratios are against it
        self.methods = list(self.policies)
        if not 1 <= config.questions <= len(QUESTIONS):
            raise UserError(
                f"questions must be between 1 and {len(QUESTIONS)}, got {config.questions}"
            )
        if config.repeats < 1:
            raise UserError(f"repeats must be at least 1, got {config.repeats}")
        room = QUESTION_ROOM + config.new_tokens
        too_long = [n for n in config.lengths if n + room > model.shape.max_positions]
        if too_long:
            raise UserError(
                f"length {too_long[0]} leaves no room for a question and {config.new_tokens} "
                f"new tokens within the model's context of {model.shape.max_positions}"
            )

    # -- one measurement ---------------------------------------------------------------------
    def measure(self, method: str, document: str, repeat: int, new_tokens: int) -> dict:
        """The document's prefill, then every question reused and from scratch, in pairs."""
        cached = self.engine.prefill(document, self.policies[method].fresh())
        sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        asked = []
        for number, question in enumerate(QUESTIONS[: self.config.questions]):
            reused_request = self.engine.continuation(cached, question, sampling)
            pair = {"reused": reused_request, "scratch": replace(reused_request, prefix=None)}
            order = list(pair) if (repeat + number) % 2 == 0 else list(pair)[::-1]
            got = {name: self.engine.generate([pair[name]])[0] for name in order}
            reused, scratch = got["reused"], got["scratch"]
            asked.append(
                {
                    "question": number,
                    "first": order[0],
                    "question_tokens": len(reused.prompt_ids) - reused.reused_tokens,
                    "reused_tokens": reused.reused_tokens,
                    "reused_ttft_s": reused.ttft_s,
                    "scratch_ttft_s": scratch.ttft_s,
                    "reused_kv_bytes": reused.kv_bytes,
                    "scratch_kv_bytes": scratch.kv_bytes,
                    "same_tokens": reused.output_ids == scratch.output_ids,
                }
            )
        return {
            "document_tokens": len(cached),
            "document_prefill_s": cached.ttft_s,
            "document_kv_bytes": cached.nbytes(),
            "questions": asked,
        }

    # -- the sweep ---------------------------------------------------------------------------
    def run(self, resume: bool, progress: bool = True) -> dict:
        cfg = self.config
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "runs.jsonl"
        header = {
            "model": cfg.model,
            "dtype": self.model.dtype_name,
            "new_tokens": cfg.new_tokens,
            "questions": cfg.questions,
            "kind": "reuse",
        }
        settings = "model, dtype, max-new-tokens and questions"
        runs = start_runs(path, header, settings, resume, self.methods, cfg.lengths)
        documents = {n: chat_document(self.model.tokenizer, n) for n in cfg.lengths}
        todo = pending_runs(runs, cfg.repeats, cfg.lengths, self.methods)
        warm = sorted({m for _, _, m in todo})  # each method once, on the shortest document
        bar = tqdm(total=len(warm) + len(todo), disable=not progress, unit="run", desc="reuse")
        for m in warm:
            bar.set_postfix_str(f"warm-up {m}")
            self.measure(m, documents[min(cfg.lengths)], 0, 2)
            bar.update()
        append_runs(
            path,
            todo,
            lambda m, n, rep: self.measure(m, documents[n], rep, cfg.new_tokens),
            runs,
            bar,
            cfg.repeats,
        )
        bar.close()
        return self.summarise(runs)

    # -- results -----------------------------------------------------------------------------
    def summarise(self, runs: list[dict]) -> dict:
        from speedkv.bench.reuse_report import write_outputs

        cells = [
            reuse_cell(runs, m, n)
            for n in self.config.lengths
            for m in self.methods
            if any(r["method"] == m and r["length"] == n for r in runs)
        ]
        result = {
            "config": config_record(self.config),
            "methods": self.methods,
            "dtype": self.model.dtype_name,
            "machine": machine_facts(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "cells": cells,
        }
        write_outputs(result, self.out)
        return result


def reuse_cell(runs: list[dict], method: str, length: int) -> dict:
    """Medians of one method at one length over repeats and questions; `*_vs_full` ratios are
    taken against full's run of the same repeat (and question), `reuse_ratio` within a pair."""
    by_key = {(r["repeat"], r["length"], r["method"]): r for r in runs}
    mine = [r for (_, n, m), r in sorted(by_key.items()) if n == length and m == method]
    pairs = [(r["repeat"], q) for r in mine for q in r["questions"]]
    cell: dict = {
        "method": method,
        "length": length,
        "repeats": len(mine),
        "pairs": len(pairs),
        "document_tokens": mine[0]["document_tokens"],
        "question_tokens": statistics.fmean(q["question_tokens"] for _, q in pairs),
        "document_kv_bytes": mine[0]["document_kv_bytes"],
        "reused_kv_bytes": statistics.median(q["reused_kv_bytes"] for _, q in pairs),
        "scratch_kv_bytes": statistics.median(q["scratch_kv_bytes"] for _, q in pairs),
        "same_tokens": statistics.fmean(q["same_tokens"] for _, q in pairs),
    }
    spread(cell, "document_prefill_s", [r["document_prefill_s"] for r in mine])
    for mode in ("reused", "scratch"):
        spread(cell, f"{mode}_ttft_s", [q[f"{mode}_ttft_s"] for _, q in pairs])
    spread(cell, "reuse_ratio", [q["reused_ttft_s"] / q["scratch_ttft_s"] for _, q in pairs])

    def full_of(repeat: int) -> dict | None:
        return by_key.get((repeat, length, "full"))

    prefill = [
        r["document_prefill_s"] / full_of(r["repeat"])["document_prefill_s"]
        for r in mine
        if full_of(r["repeat"])
    ]
    cell["document_prefill_vs_full"] = statistics.median(prefill) if prefill else None
    for mode in ("reused", "scratch"):
        ratios = [
            q[f"{mode}_ttft_s"] / full_of(rep)["questions"][q["question"]][f"{mode}_ttft_s"]
            for rep, q in pairs
            if full_of(rep)
        ]
        cell[f"{mode}_ttft_vs_full"] = statistics.median(ratios) if ratios else None
    full_runs = [full_of(r["repeat"]) for r in mine if full_of(r["repeat"])]
    cell["document_kv_vs_full"] = (
        cell["document_kv_bytes"] / full_runs[0]["document_kv_bytes"] if full_runs else None
    )
    return cell


def spread(cell: dict, key: str, values: list[float]) -> None:
    """The median of `values` under `key`, their extremes under `key_min` and `key_max`."""
    cell[key] = statistics.median(values)
    cell[key + "_min"], cell[key + "_max"] = min(values), max(values)
