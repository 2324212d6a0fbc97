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

import math
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from speedkv.core.engine import Engine
from speedkv.core.policy import Policy
from speedkv.errors import UserError
from speedkv.evals.render import length_label, pyplot, wrap_spec
from speedkv.evals.task import (
    DEFAULT_CONTINUATION_TOKENS,
    FULL,
    Column,
    EvalConfig,
    Services,
    Table,
    Task,
    Timing,
    Unit,
    base_record,
)
from speedkv.prompts.builders import raw_passage
from speedkv.prompts.haystack import sentence_count

DEFAULT_TOKENS = DEFAULT_CONTINUATION_TOKENS


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


# -- the task -----------------------------------------------------------------------------------
class FidelityTask(Task):
    """Every method teacher-forced through the same passage; full attention's distributions,
    computed once per sample (on the reference model with --reference), are the yardstick."""

    name = "fidelity"
    description = (
        "teacher-forced continuation of an essay: perplexity, top-1 agreement and KL against full"
    )
    default_samples = 4
    methodology = """\
**fidelity**: the prompt is the first `length` tokens of an essay passage. It is raw text with
the tokenizer's own special tokens and no chat template; sample `i` starts at the same sentence
at every length. The next tokens of the same passage are teacher-forced through the method's
real decode path. Reported: perplexity of those tokens, its ratio to full's on the same tokens,
top-1 agreement with full's argmax and the mean KL(full || method).
"""
    tables_shown = (
        Table(
            "perplexity ratio to full (1 = unchanged, above 1 = worse)",
            "ppl_ratio",
            "{:.3f}".format,
        ),
        Table("top-1 agreement with full", "agreement", "{:.3f}".format),
        Table("KL(full || method), nats per token", "kl", "{:.4f}".format),
        Table("perplexity", "ppl", "{:.2f}".format),
    )
    # perplexity ratios run from 1 (green) to 1.5 (red) in the overview plot
    headline = Column("ppl_ratio", "ppl ratio", "{:.3f}".format, lambda v: max(0.0, 3 - 2 * v))
    compared = (
        Column("ppl", "ppl", "{:.2f}".format),
        Column("ppl_ratio", "ppl ratio", "{:.3f}".format),
        Column("agreement", "top-1 agr.", "{:.3f}".format),
    )
    figures = {"fidelity.png": "perplexity ratio, top-1 agreement and KL against full"}

    def check_settings(self, ctx: Services) -> None:
        tokens = ctx.config.fidelity_tokens
        if tokens < 1:
            raise UserError(f"continuation-tokens must be at least 1, got {tokens}")

    def validate(self, ctx: Services, length: int) -> None:
        self.check_room(ctx, length, ctx.config.fidelity_tokens)

    def run(
        self, ctx: Services, unit: Unit, methods: list[str], records: list[dict]
    ) -> Iterator[dict]:
        cfg = ctx.config
        sample = build_sample(
            ctx.model.tokenizer, unit.length, cfg.fidelity_tokens, unit.index, cfg.seed,
            cfg.split,
        )  # fmt: skip
        # full's distributions are the reference for every method of this sample: computed
        # once here, whether or not full's own record is still pending
        t0 = time.perf_counter()
        reference = teacher_forced_logprobs(
            ctx.reference_engine, sample.prompt, sample.continuation, ctx.reference_full.fresh()
        )
        full_seconds = time.perf_counter() - t0
        own_reference = ctx.reference_engine is ctx.engine
        for method in methods:
            t0 = time.perf_counter()
            reused = method == FULL and own_reference
            if reused:
                logprobs = reference
            else:
                policy = ctx.policies[method].fresh()  # per-prompt state stays with this prompt
                logprobs = teacher_forced_logprobs(
                    ctx.engine, sample.prompt, sample.continuation, policy
                )
            seconds = full_seconds if reused else time.perf_counter() - t0
            metrics = compare(logprobs, reference, sample.continuation)
            yield {
                **base_record(method, unit, len(sample.prompt)),
                "start": sample.start,
                "tokens": len(sample.continuation),
                **metrics,
                "ppl": math.exp(metrics["nll"]),
                "ppl_ratio": math.exp(metrics["nll"] - metrics["nll_full"]),
                "score": metrics["agreement"],
                "seconds": seconds,
            }

    def estimate_seconds(
        self, unit: Unit, methods: list[str], config: EvalConfig, timing: Timing
    ) -> float:
        runs = len(methods) + (FULL not in methods)  # full's distributions are always made
        return runs * timing.run_seconds(unit.length, config.fidelity_tokens)

    def summarise(self, records: list[dict]) -> dict:
        if not records:
            keys = ("nll", "ppl", "ppl_full", "ppl_ratio", "agreement", "kl", "top1_text")
            return dict.fromkeys(keys)
        nll = statistics.fmean(r["nll"] for r in records)
        nll_full = statistics.fmean(r["nll_full"] for r in records)
        return {
            "nll": nll,
            "ppl": math.exp(nll),
            "ppl_full": math.exp(nll_full),
            "ppl_ratio": math.exp(nll - nll_full),  # ratio of corpus perplexities, same tokens
            "agreement": statistics.fmean(r["agreement"] for r in records),
            "kl": statistics.fmean(r["kl"] for r in records),
            "top1_text": statistics.fmean(r["top1_text"] for r in records),
        }

    def plot(self, result: dict, out: Path) -> list[Path]:
        path = plot_fidelity(result, out)
        return [] if path is None else [path]


FIDELITY = FidelityTask()


def plot_fidelity(result: dict, out: Path) -> Path | None:
    """Perplexity ratio, top-1 agreement and KL per method: a dot per prompt length."""
    rows = [r for r in result["summary"] if r["task"] == FIDELITY.name]
    if not rows:
        return None
    plt = pyplot()
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    cells = {(r["method"], r["length"]): r for r in rows}
    panels = [
        ("ppl_ratio", "perplexity ratio to full", 1.0),
        ("agreement", "top-1 agreement with full", 1.0),
        ("kl", "KL(full || method), nats per token", 0.0),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 1.4 + 0.4 * len(methods)), sharey=True)
    ys = list(range(len(methods)))
    for ax, (key, label, reference) in zip(axes, panels):
        for n, marker in zip(lengths, "osD^v<>"):
            xs = [cells[(m, n)][key] if (m, n) in cells else math.nan for m in methods]
            ax.plot(xs, ys, marker, label=f"{length_label(n)} tokens", alpha=0.8)
        ax.axvline(reference, color="black", lw=0.8)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_yticks(ys, [wrap_spec(m) for m in methods], fontsize=7)
    axes[0].invert_yaxis()
    axes[0].legend(fontsize=7)
    fig.suptitle(f"fidelity against full ({result['config']['model']})", fontsize=9)
    fig.tight_layout()
    path = out / "fidelity.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
