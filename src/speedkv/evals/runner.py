"""`speedkv eval`: methods x tasks x lengths x samples, one record per run.

Work goes sample by sample: a sample's prompt is built once and every pending method runs on
it, `full` first (the reference the others are compared with). Each method runs alone, so its
numbers never depend on which other methods share the sweep, and a resumed run gives the same
records as an uninterrupted one. Records are appended to `records.jsonl` as they finish;
`--resume` skips every (method, task, length, sample) already there.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from speedkv.bench.machine import machine_label
from speedkv.core.engine import Engine, Request, check_reusable
from speedkv.core.policy import Policy
from speedkv.core.prefix import CachedPrefix
from speedkv.core.registry import MethodSpec, config_record, make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.errors import UserError
from speedkv.evals import fidelity, needles, reuse, ruler, sanity
from speedkv.evals.tasks import (
    DEFAULT_DEPTHS,
    SHORT,
    TASK_NAMES,
    TASKS,
    is_needle,
    max_new_tokens,
    records_per_run,
)
from speedkv.hf.loading import LoadedModel
from speedkv.hf.text import EncodedPrompt
from speedkv.methods.speed import Speed
from speedkv.prompts.builders import QUESTION_ROOM

# Bump when prompts, wording or scoring change: records made under another version are not
# mixed with new ones on --resume.
TASK_VERSION = 1
FULL = "full"


@dataclass
class EvalConfig:
    model: str
    methods: list[MethodSpec | str]  # parsed specs, or their text
    tasks: list[str]
    lengths: list[int]
    n: dict[str, int]
    seed: int = 0
    dtype: str = "auto"
    depths: list[float] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    fidelity_tokens: int = fidelity.DEFAULT_TOKENS
    split: str = "eval"
    adapter: str | None = None  # LoRA adapter merged into the model (every method runs with it)
    # needle questions in a user message of their own after the document's (the layout of a
    # cached document asked a question; `deep=turn` then keeps only the question deep)
    question_turn: bool = False
    # needle and RULER samples (question in view) prefill once with full attention; full and
    # every SPEED method start from that cache (SPEED's lower layers and anchors are full
    # attention's), so a sweep over cutoffs and anchors costs about one prefill per sample
    # (equal up to rounding); SPEED's TTFT is then not measured
    shared_prefill: bool = False
    # fidelity and sanity compare with full attention on this model instead of the evaluated
    # one's own (e.g. a full-depth fine-tune against a SPEED-trained one); same tokenizer
    reference: str | None = None
    # RULER: each sample's context (up to its question) is cached first, as a document later
    # questions reuse, and the question continues that cache; only methods whose cache does
    # not depend on what follows (full, speed) can run so
    query_agnostic: bool = False
    # where RULER's generated samples are kept (default $SPEEDKV_CACHE/ruler); not a setting
    # of the results: the same key gives the same samples wherever they are
    ruler_data: str | None = None


@dataclass(frozen=True)
class Unit:
    """One sample of one task at one length; every method runs on it."""

    task: str
    length: int
    index: int


class EvalRunner:
    def __init__(
        self,
        model: LoadedModel,
        config: EvalConfig,
        out: Path,
        reference: LoadedModel | None = None,
    ):
        if model.tokenizer is None:
            raise UserError("evaluation needs a model with a tokenizer")
        if (reference is None) != (config.reference is None):
            raise ValueError("give the reference model and its name in the config together")
        if reference is not None:
            same_tokens(model, reference, config.reference)
        self.model, self.config, self.out = model, with_ruler_tasks(config), out
        self.engine = Engine(model)
        # whose full attention fidelity and sanity compare with: the model's own by default
        self.reference_engine = Engine(reference) if reference is not None else self.engine
        self.reference_full = make_policy(FULL, (reference or model).shape)
        specs = list(dict.fromkeys([FULL, *config.methods]))  # full is every task's reference
        policies = [make_policy(spec, model.shape) for spec in specs]
        self.policies: dict[str, Policy] = {p.spec(): p for p in policies}
        self.methods = list(self.policies)
        self._ruler_samples: dict[tuple[str, int], list[ruler.RulerSample]] = {}
        self._validate()

    # -- checks ------------------------------------------------------------------------------
    def _validate(self) -> None:
        cfg, shape, tok = self.config, self.model.shape, self.model.tokenizer
        unknown = [t for t in cfg.tasks if t not in TASKS]
        if unknown:
            raise UserError(f"unknown task '{unknown[0]}'; tasks: {TASK_NAMES}")
        for task, count in cfg.n.items():
            if count < 1:
                raise UserError(f"--samples must be at least 1 sample, got {count} for {task}")
        if cfg.fidelity_tokens < 1:
            raise UserError(f"continuation-tokens must be at least 1, got {cfg.fidelity_tokens}")
        if any(not 0.0 <= d <= 1.0 for d in cfg.depths) or not cfg.depths:
            raise UserError(f"depths must be fractions between 0 and 1, got {cfg.depths}")
        if cfg.query_agnostic:
            self._check_query_agnostic()
        if not any(t != "sanity" for t in cfg.tasks):
            return  # sanity alone uses no --lengths
        if not cfg.lengths:
            raise UserError("give at least one prompt length, e.g. --lengths 2048")
        if any(ruler.is_ruler(t) for t in cfg.tasks):
            ruler.require()
        for length in cfg.lengths:
            if length > shape.max_positions:
                raise UserError(
                    f"length {length} is longer than the model's context of "
                    f"{shape.max_positions} tokens"
                )
            for task in cfg.tasks:
                if ruler.is_ruler(task):
                    least = ruler.min_length(task)
                    if length < least:
                        raise UserError(
                            f"length {length} is too short for task {task}: RULER's generator "
                            f"needs at least {least} tokens ({ruler.why_min_length(task)})"
                        )
                    continue  # the prompt's exact room is checked once it is generated
                if task == reuse.TASK:
                    needed = 2 * reuse.shortest_document(tok)
                    if length < needed:
                        raise UserError(
                            f"length {length} is too short for task reuse: it needs at least "
                            f"{needed} tokens (half of them essay text)"
                        )
                    room = length + QUESTION_ROOM + max_new_tokens(task)
                elif is_needle(task):
                    needed = 2 * needles.shortest_prompt(tok, task, cfg.question_turn)
                    if length < needed:
                        raise UserError(
                            f"length {length} is too short for task {task}: it needs at least "
                            f"{needed} tokens (half of them essay text)"
                        )
                    room = length + max_new_tokens(task)
                elif task == "fidelity":
                    room = length + cfg.fidelity_tokens
                else:
                    continue
                if room > shape.max_positions:
                    raise UserError(
                        f"length {length} leaves no room for task {task}'s "
                        f"{room - length} new tokens within the model's context of "
                        f"{shape.max_positions}"
                    )

    def _check_query_agnostic(self) -> None:
        if self.config.shared_prefill:
            raise UserError(
                "--shared-prefill does not go with --query-agnostic: each method caches the "
                "context before its question itself"
            )
        other = [t for t in self.config.tasks if not ruler.is_ruler(t)]
        if other:
            raise UserError(
                f"--query-agnostic applies to RULER tasks only, not {', '.join(other)} (needle "
                "tasks ask a cached document with --question-turn)"
            )
        for method in self.methods:
            try:
                check_reusable(self.policies[method])
            except UserError as e:
                raise UserError(
                    f"--query-agnostic caches each context before its question, which {method} "
                    f"cannot: {e}"
                ) from None

    # -- the plan ----------------------------------------------------------------------------
    def units(self) -> list[Unit]:
        cfg = self.config
        out = []
        for task in cfg.tasks:
            lengths = [SHORT] if task == "sanity" else cfg.lengths
            count = cfg.n[task]
            if task == "sanity":
                count = min(count, len(sanity.prompts(cfg.split)))
            out += [Unit(task, length, i) for length in lengths for i in range(count)]
        # sample-major: a sweep stopped halfway has every task and length at fewer samples,
        # rather than the first tasks complete and the last ones missing
        order = {task: k for k, task in enumerate(cfg.tasks)}
        return sorted(out, key=lambda u: (u.index, order[u.task], u.length))

    def header(self) -> dict:
        cfg = self.config
        return {
            "model": cfg.model,
            "dtype": self.model.dtype_name,
            "seed": cfg.seed,
            "split": cfg.split,
            "depths": cfg.depths,
            "fidelity_tokens": cfg.fidelity_tokens,
            "task_version": TASK_VERSION,
            "adapter": cfg.adapter,
            # only when set, so runs made before the option resume as they were
            **({"question_turn": True} if cfg.question_turn else {}),
            **({"shared_prefill": True} if cfg.shared_prefill else {}),
            **({"setting": "agnostic"} if cfg.query_agnostic else {}),
            **({"reference": cfg.reference} if cfg.reference else {}),
            # the package that generates and scores RULER's samples (only when it does)
            **(
                {"ruler": f"{ruler.PACKAGE} {ruler.package_version()}"}
                if any(ruler.is_ruler(t) for t in cfg.tasks)
                else {}
            ),
        }

    # -- the sweep ---------------------------------------------------------------------------
    def run(
        self, resume: bool = False, progress: bool = True, log=None, plots: bool = True
    ) -> dict:
        started = time.perf_counter()
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "records.jsonl"
        records = whole_runs(self._load(path)) if resume else []
        if not resume or not path.exists():
            path.write_text(json.dumps({"header": self.header()}) + "\n")
        done = {record_key(r) for r in records}
        todo = [
            (unit, [m for m in self.methods if (m, unit.task, unit.length, unit.index) not in done])
            for unit in self.units()
        ]
        todo = [(unit, methods) for unit, methods in todo if methods]
        self._prepare_ruler([unit for unit, _ in todo], log)
        runs = sum(len(methods) for _, methods in todo)
        if log and runs:
            seconds = self.estimate_seconds(todo)
            log(
                f"{runs} runs to do ({len(records)} already recorded); estimated at most "
                f"{seconds / 60:.0f} min on this machine now (every method costed as full)"
            )
        expected = sum(len(methods) * records_per_run(unit.task) for unit, methods in todo)
        bar = tqdm(
            total=expected, disable=not progress, unit="record", desc="eval", dynamic_ncols=True
        )
        machine = machine_label()  # a sweep resumed elsewhere says which answers came from where
        with path.open("a") as sink:
            for unit, methods in todo:
                bar.set_postfix_str(f"{unit.task} @ {unit.length} #{unit.index}")
                for record in self.run_unit(unit, methods, records):
                    record["machine"] = machine
                    sink.write(json.dumps(record) + "\n")  # kept even if the sweep stops here
                    sink.flush()
                    records.append(record)
                    bar.update()
        bar.close()
        from speedkv.evals.report import summarise, write_outputs

        wanted = {(m, u.task, u.length, u.index) for u in self.units() for m in self.methods}
        mine = sorted((r for r in records if record_key(r) in wanted), key=self._record_order)
        result = {
            "config": config_record(self.config),
            "methods": self.methods,
            "header": self.header(),
            "versions": versions(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "elapsed_s": time.perf_counter() - started,
            "summary": summarise(mine, self.methods, self.config.tasks),
            "records": mine,
        }
        write_outputs(result, self.out, plots)
        return result

    def _record_order(self, r: dict) -> tuple:
        return (
            self.config.tasks.index(r["task"]),
            r["length"],
            r["sample"],
            self.methods.index(r["method"]),
            r.get("question", 0),
        )

    def _load(self, path: Path) -> list[dict]:
        if not path.exists():
            return []
        lines = []
        text = path.read_text().splitlines()
        for number, line in enumerate(text):
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                if number < len(text) - 1:  # only the last line may be cut short by a kill
                    raise UserError(
                        f"{path} line {number + 1} is not JSON; use another --out"
                    ) from None
                path.write_text("".join(json.dumps(r) + "\n" for r in lines))  # drop it
        header = self.header()
        if not lines or lines[0].get("header") != header:
            found = lines[0].get("header") if lines else "none"
            raise UserError(
                f"{path} was made with other settings ({found}); use another --out, or the "
                "same model, dtype, seed, split, depths and continuation-tokens"
            )
        return lines[1:]

    # -- one sample, every pending method ------------------------------------------------------
    def run_unit(self, unit: Unit, methods: list[str], records: list[dict]) -> Iterator[dict]:
        """Records of `methods` on one sample, each as soon as it is done; full's first."""
        if is_needle(unit.task):
            return self._needle(unit, methods)
        if unit.task == "fidelity":
            return self._fidelity(unit, methods)
        if unit.task == reuse.TASK:
            return self._reuse(unit, methods)
        if ruler.is_ruler(unit.task):
            return self._ruler(unit, methods, records)
        return self._sanity(unit, methods, records)

    def _generate(
        self, method: str, prompt: EncodedPrompt, new: int, prefix: CachedPrefix | None = None
    ):
        """Greedy answer; the prompt's header and last turn go along, so `deep=header` and
        `deep=turn` mean what they say. With `prefix`, it starts from that cache."""
        request = Request(
            prompt.ids,
            self.policies[method],
            SamplingParams(max_new_tokens=new),
            prompt.header_tokens,
            prompt.turn_tokens,
            prefix,
        )
        return self.engine.generate([request])[0]  # the engine copies the policy per request

    def _shared_prefixes(
        self, prompt: EncodedPrompt, methods: list[str]
    ) -> tuple[dict[str, CachedPrefix], float]:
        """With shared_prefill, the cache each method that can take one starts from: full's
        own prompt cache, and SPEED's taken from it; one full prefill for all of them. Also
        each taker's share of the seconds that took, which its record's `seconds` counts."""
        takers = [m for m in methods if m == FULL or self._takes_full(m)]
        if not self.config.shared_prefill or not takers:
            return {}, 0.0
        t0 = time.perf_counter()
        full = self.engine.prefill(prompt.ids, FULL)
        out = {}
        for method in takers:
            policy = self.policies[method]
            out[method] = (
                full
                if method == FULL
                else policy.prefix_from_full(full, prompt.header_tokens, prompt.turn_tokens)
            )
        return out, (time.perf_counter() - t0) / len(out)

    def _takes_full(self, method: str) -> bool:
        policy = self.policies[method]
        return isinstance(policy, Speed) and not policy.config.selfonly

    def _needle(self, unit: Unit, methods: list[str]) -> Iterator[dict]:
        cfg = self.config
        sample = needles.build_sample(
            self.model.tokenizer, unit.task, unit.length, unit.index, cfg.seed, cfg.depths,
            cfg.split, cfg.question_turn,
        )  # fmt: skip
        shared, share_s = self._shared_prefixes(sample.prompt, methods)
        for method in methods:
            t0 = time.perf_counter() - (share_s if method in shared else 0.0)
            g = self._generate(method, sample.prompt, max_new_tokens(unit.task), shared.get(method))
            found = needles.found_values(g.text, sample.expected)
            yield {
                **base_record(method, unit, len(sample.prompt.ids)),
                "depth": sample.depth,
                "start": sample.start,
                "expected": sample.expected,
                "answer": g.text,
                "found": found,
                "correct": len(found) == len(sample.expected),
                "score": float(len(found) == len(sample.expected)),
                "recall": len(found) / len(sample.expected),
                "output_tokens": len(g.output_ids),
                "finish_reason": g.finish_reason,
                "question": sample.question,
                "facts": sample.facts,
                "seconds": time.perf_counter() - t0,
            }

    def _fidelity(self, unit: Unit, methods: list[str]) -> Iterator[dict]:
        cfg = self.config
        sample = fidelity.build_sample(
            self.model.tokenizer, unit.length, cfg.fidelity_tokens, unit.index, cfg.seed,
            cfg.split,
        )  # fmt: skip
        # full's distributions are the reference for every method of this sample: computed
        # once here, whether or not full's own record is still pending
        t0 = time.perf_counter()
        reference = fidelity.teacher_forced_logprobs(
            self.reference_engine, sample.prompt, sample.continuation, self.reference_full.fresh()
        )
        full_seconds = time.perf_counter() - t0
        own_reference = self.reference_engine is self.engine
        for method in methods:
            t0 = time.perf_counter()
            reused = method == FULL and own_reference
            logprobs = reference if reused else self._logprobs(method, sample)
            seconds = full_seconds if reused else time.perf_counter() - t0
            metrics = fidelity.compare(logprobs, reference, sample.continuation)
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

    def _logprobs(self, method: str, sample: fidelity.FidelitySample) -> torch.Tensor:
        policy = self.policies[method].fresh()  # per-prompt state stays with this prompt
        return fidelity.teacher_forced_logprobs(
            self.engine, sample.prompt, sample.continuation, policy
        )

    def _sanity(self, unit: Unit, methods: list[str], records: list[dict]) -> Iterator[dict]:
        from speedkv.hf.text import encode_prompt

        prompt = sanity.prompts(self.config.split)[unit.index]
        encoded = encode_prompt(self.model.tokenizer, prompt)
        own_reference = self.reference_engine is self.engine
        if own_reference:
            reference = next(
                (r for r in records if record_key(r) == (FULL, unit.task, unit.length, unit.index)),
                None,
            )
        else:  # the reference model's greedy answer, made again on every resume (it is short)
            request = Request(
                encoded.ids,
                self.reference_full,
                SamplingParams(max_new_tokens=sanity.MAX_NEW_TOKENS),
            )
            g = self.reference_engine.generate([request])[0]
            reference = {"output_ids": g.output_ids, "answer": g.text}
        for method in methods:
            t0 = time.perf_counter()
            g = self._generate(method, encoded, sanity.MAX_NEW_TOKENS)
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
                "token_agreement": sanity.token_agreement(g.output_ids, full_ids),
                "output_ids": g.output_ids,
                "finish_reason": g.finish_reason,
                "seconds": time.perf_counter() - t0,
            }
            if mine:
                reference = record
            yield record

    def _reuse(self, unit: Unit, methods: list[str]) -> Iterator[dict]:
        """A method's records for one document come together, one per question: each asked
        fresh and over the cached document."""
        cfg = self.config
        quiz = reuse.build_quiz(self.model.tokenizer, unit.length, unit.index, cfg.seed, cfg.split)
        for method in methods:
            t0 = time.perf_counter()
            answers = reuse.ask(self.engine, self.policies[method], quiz, max_new_tokens(unit.task))
            seconds = (time.perf_counter() - t0) / len(answers)
            for answer in answers:
                prompt_tokens = answer.pop("prompt_tokens")
                yield {
                    **base_record(method, unit, prompt_tokens),
                    **answer,
                    "score": float(answer["fresh_correct"]),  # reused: `reused_correct`
                    "seconds": seconds,
                }

    def _prepare_ruler(self, units: list[Unit], log=None) -> None:
        """Generate (or find) the RULER samples the pending units need, all tasks at once, and
        check that each prompt leaves room for its answer in the model's context."""
        wanted = sorted({(u.task, u.length) for u in units if ruler.is_ruler(u.task)})
        if not wanted:
            return
        cfg, tok = self.config, self.model.tokenizer
        root = ruler.data_root(cfg.ruler_data)
        ruler.ensure_samples(tok, [(t, n, cfg.n[t]) for t, n in wanted], cfg.seed, root, log)
        context = self.model.shape.max_positions
        too_long = []
        for task, length in wanted:
            samples = ruler.load_samples(tok, task, length, cfg.seed, cfg.n[task], root)
            longest = max(len(s.prompt.ids) for s in samples) + max_new_tokens(task)
            if longest > context:
                too_long.append(f"{task} at {length} ({longest} tokens with its answer)")
            self._ruler_samples[(task, length)] = samples
        if too_long:
            # RULER fits its text to the length (fwe without its answer); the chat template
            # comes on top
            margin = ruler.longest_answer()
            raise UserError(
                f"the model's context of {context} tokens has no room for the longest prompt, "
                f"with the chat template and its answer, of {', '.join(too_long)}. RULER's "
                f"length counts its text alone: a length {margin} tokens under the context "
                f"(--lengths {context - margin}) leaves room for both"
            )

    def _ruler(self, unit: Unit, methods: list[str], records: list[dict]) -> Iterator[dict]:
        """RULER's sample `unit.index`: every method answers the same saved prompt, scored with
        the package's metric; KV and TTFT are taken against full's on the same prompt."""
        if (unit.task, unit.length) not in self._ruler_samples:  # run_unit called on its own
            self._prepare_ruler([unit])
        sample = self._ruler_samples[(unit.task, unit.length)][unit.index]
        key = (FULL, unit.task, unit.length, unit.index)
        reference = next((r for r in records if record_key(r) == key), None)
        context = (
            ruler.context_tokens(self.model.tokenizer, sample)
            if self.config.query_agnostic
            else None
        )
        # with shared_prefill (refused with query_agnostic), full and SPEED start from one full
        # prefill of the whole prompt; SPEED's own prefill is then not timed: no TTFT recorded
        shared, share_s = self._shared_prefixes(sample.prompt, methods)
        for method in methods:
            t0 = time.perf_counter() - (share_s if method in shared else 0.0)
            cached = (
                shared.get(method)
                if context is None
                else self.engine.prefill(sample.prompt.ids[:context], method)
            )
            g = self._generate(method, sample.prompt, max_new_tokens(unit.task), cached)
            # query-agnostic: the first question pays for the context's prefill too
            untimed = method in shared and method != FULL
            ttft_s = None if untimed else g.ttft_s + (cached.ttft_s if cached else 0.0)
            # full runs first on a sample, or was recorded before a resume
            full = {"kv_bytes": g.kv_bytes, "ttft_s": ttft_s} if method == FULL else reference
            record = {
                **base_record(method, unit, len(sample.prompt.ids)),
                "id": sample.index,
                "input_sha": sample.input_sha,
                "ruler_length": sample.length,
                "reply_start": sample.reply_start,
                "answer": g.text,
                "references": sample.outputs,
                "metric": ruler.task_spec(unit.task).metric,
                "score": ruler.score(unit.task, g.text, sample.outputs),
                "output_tokens": len(g.output_ids),
                "finish_reason": g.finish_reason,
                "kv_bytes": g.kv_bytes,
                "kv_ratio": g.kv_bytes / full["kv_bytes"],
                "ttft_s": ttft_s,
                "ttft_ratio": None if ttft_s is None else ttft_s / full["ttft_s"],
                **({"prefill_shared": True} if method in shared else {}),
                "seconds": time.perf_counter() - t0,
                # a shared prefill is a cache too, but of the whole prompt: question in view
                **({"setting": "agnostic", "context_tokens": context} if context else {}),
            }
            if method == FULL:
                reference = record
            yield record

    # -- time estimate -------------------------------------------------------------------------
    def estimate_seconds(
        self,
        todo: list[tuple[Unit, list[str]]],
        prefill_s: float | None = None,
        step_s: float | None = None,
    ) -> float:
        """Seconds the pending runs should take, every method costed as full: full's prefill
        and decode-step times on a 512-token prompt (measured now unless given), scaled with
        length (linear work plus attention that grows with the prompt)."""
        if prefill_s is None or step_s is None:
            prefill_s, step_s = self._measure_full(512, 8)
        total = 0.0
        for unit, methods in todo:
            length = 64 if unit.task == "sanity" else unit.length
            new = (
                self.config.fidelity_tokens
                if unit.task == "fidelity"
                else max_new_tokens(unit.task)
            )
            # a reuse document: one prefill per question and the document's, each question
            # answered twice
            prefills, answers = (
                (reuse.QUESTIONS + 1, 2 * reuse.QUESTIONS) if unit.task == reuse.TASK else (1, 1)
            )
            per = prefills * prefill_s * _prefill_cost(length) / _prefill_cost(512)
            per += answers * new * step_s * _step_cost(length) / _step_cost(512)
            runs = len(methods) + (unit.task == "fidelity" and FULL not in methods)
            total += runs * per
        return total

    def _measure_full(self, length: int, steps: int) -> tuple[float, float]:
        ids = fidelity.build_sample(self.model.tokenizer, length, steps, 0, 0, self.config.split)
        policy = self.policies[FULL].fresh()
        self.engine.prefill_ids(ids.prompt[:32], policy.fresh())  # warm-up
        t0 = time.perf_counter()
        done = self.engine.prefill_ids(ids.prompt, policy, spare=steps)
        t1 = time.perf_counter()
        for i, token in enumerate(ids.continuation):
            self.engine.decode_step([done.cache], [policy], [token], [done.next_position + i])
        t2 = time.perf_counter()
        return t1 - t0, (t2 - t1) / steps


def _prefill_cost(n: int) -> float:
    return n * (1 + n / 2560)  # fitted to SmolLM2 bf16 prefill at 2K and 8K on a 2-core CPU


def _step_cost(n: int) -> float:
    return 1 + n / 1024  # a fixed cost per step, plus reading a cache that grows


def with_ruler_tasks(config: EvalConfig) -> EvalConfig:
    """`ruler` in the tasks, or as a sample count, stands for each of RULER's 13 tasks (as on
    the command line); a task's own count wins."""
    if ruler.GROUP not in config.tasks and ruler.GROUP not in config.n:
        return config
    tasks = ruler.expand(config.tasks)
    n = {t: count for t, count in config.n.items() if t != ruler.GROUP}
    if ruler.GROUP in config.n:
        for task in tasks:
            if ruler.is_ruler(task):
                n.setdefault(task, config.n[ruler.GROUP])
    return replace(config, tasks=tasks, n=n)


def same_tokens(model: LoadedModel, reference: LoadedModel, name: str) -> None:
    """Token-level comparisons need one vocabulary: the same token ids for the same text."""
    if (
        reference.tokenizer is None
        or reference.tokenizer.get_vocab() != model.tokenizer.get_vocab()
    ):
        raise UserError(
            f"reference model {name} does not share {model.name}'s tokenizer; fidelity and "
            "sanity compare token by token, so it must"
        )


def base_record(method: str, unit: Unit, prompt_tokens: int) -> dict:
    return {
        "method": method,
        "task": unit.task,
        "length": unit.length,
        "sample": unit.index,
        "prompt_tokens": prompt_tokens,
    }


def record_key(record: dict) -> tuple[str, str, int, int]:
    return (record["method"], record["task"], record["length"], record["sample"])


def whole_runs(records: list[dict]) -> list[dict]:
    """The records of runs that finished, the last copy of each: a run that writes several
    records (reuse: one per question) and was cut short by a kill is run again on resume."""
    latest = {(*record_key(r), r.get("question")): r for r in records}
    counts: dict[tuple, int] = {}
    for r in latest.values():
        counts[record_key(r)] = counts.get(record_key(r), 0) + 1
    return [r for r in latest.values() if counts[record_key(r)] >= records_per_run(r["task"])]


def versions() -> dict:
    from speedkv.bench.machine import machine_facts
    from speedkv.version import __version__

    return {"speedkv": __version__, **machine_facts()}
