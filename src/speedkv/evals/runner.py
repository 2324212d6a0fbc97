"""`speedkv eval`: methods x tasks x lengths x samples, one record per run.

Work goes sample by sample: a sample's prompt is built once and every pending method runs on
it, `full` first (the reference the others are compared with). Each method runs alone, so its
numbers never depend on which other methods share the sweep, and a resumed run gives the same
records as an uninterrupted one. Records are appended to `records.jsonl` as they finish;
`--resume` skips every (method, task, length, sample) already there.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from speedkv.bench.machine import machine_label
from speedkv.core.engine import Engine, Generation, Request
from speedkv.core.policy import Policy
from speedkv.core.prefix import CachedPrefix
from speedkv.core.registry import config_record, make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.errors import UserError
from speedkv.evals.task import FULL, EvalConfig, Timing, Unit, record_key
from speedkv.evals.tasks import expand_groups, get_task, kinds, records_per_run
from speedkv.hf.loading import LoadedModel
from speedkv.hf.text import EncodedPrompt
from speedkv.methods.speed import Speed
from speedkv.prompts.builders import raw_passage

# Bump when prompts, wording or scoring change: records made under another version are not
# mixed with new ones on --resume.
TASK_VERSION = 1


class EvalRunner:
    """The sweep: every task of the config (each a `Task` from the registry) at every length,
    sample by sample, every method on each sample. It offers tasks the models, engines and
    methods (task.Services) and names no task itself."""

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
        self.model, self.config, self.out = model, expand_groups(config), out
        self.engine = Engine(model)
        # whose full attention fidelity and sanity compare with: the model's own by default
        self.reference_engine = Engine(reference) if reference is not None else self.engine
        self.reference_full = make_policy(FULL, (reference or model).shape)
        specs = list(dict.fromkeys([FULL, *config.methods]))  # full is every task's reference
        policies = [make_policy(spec, model.shape, model.trained_method) for spec in specs]
        self.policies: dict[str, Policy] = {p.spec(): p for p in policies}
        self.methods = list(self.policies)
        self.samples: dict[tuple[str, int], Any] = {}  # what tasks prepared, by (task, length)
        self._validate()

    # -- checks ------------------------------------------------------------------------------
    def _validate(self) -> None:
        cfg, shape = self.config, self.model.shape
        tasks = [get_task(t) for t in cfg.tasks]  # unknown names are refused
        for task, count in cfg.n.items():
            if count < 1:
                raise UserError(f"--samples must be at least 1 sample, got {count} for {task}")
        for kind in kinds():  # settings belong to every run, whichever tasks it has
            kind.check_settings(self)
        if not any(task.uses_lengths for task in tasks):
            return  # no task of the run takes --lengths (sanity's prompts are their own)
        if not cfg.lengths:
            raise UserError("give at least one prompt length, e.g. --lengths 2048")
        for length in cfg.lengths:
            if length > shape.max_positions:
                raise UserError(
                    f"length {length} is longer than the model's context of "
                    f"{shape.max_positions} tokens"
                )
            for task in tasks:
                task.validate(self, length)

    # -- the plan ----------------------------------------------------------------------------
    def units(self) -> list[Unit]:
        cfg = self.config
        out = [unit for task in cfg.tasks for unit in get_task(task).units(cfg)]
        # sample-major: a sweep stopped halfway has every task and length at fewer samples,
        # rather than the first tasks complete and the last ones missing
        order = {task: k for k, task in enumerate(cfg.tasks)}
        return sorted(out, key=lambda u: (u.index, order[u.task], u.length))

    def header(self) -> dict:
        cfg = self.config
        header = {
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
        }
        for task in cfg.tasks:  # what the tasks in the run add (RULER: its package's version)
            header.update(get_task(task).header(cfg))
        return header

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
        self._prepare([unit for unit, _ in todo], log)
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
    def _prepare(self, units: list[Unit], log=None) -> None:
        """Each kind of task makes what its pending units need, all of its tasks at once."""
        for kind in kinds():
            mine = [u for u in units if type(get_task(u.task)) is type(kind)]
            if mine:
                kind.prepare(self, mine, log)

    def run_unit(self, unit: Unit, methods: list[str], records: list[dict]) -> Iterator[dict]:
        """Records of `methods` on one sample, each as soon as it is done; full's first."""
        return get_task(unit.task).run(self, unit, methods, records)

    def generate(
        self, method: str, prompt: EncodedPrompt, new: int, prefix: CachedPrefix | None = None
    ) -> Generation:
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

    def shared_prefixes(
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
        return isinstance(policy, Speed) and not (policy.config.selfonly or policy.config.stride)

    # -- time estimate -------------------------------------------------------------------------
    def estimate_seconds(
        self,
        todo: list[tuple[Unit, list[str]]],
        prefill_s: float | None = None,
        step_s: float | None = None,
    ) -> float:
        """Seconds the pending runs should take, every method costed as full: full's prefill
        and decode-step times on a 512-token prompt (measured now unless given), scaled to each
        task's runs by the task."""
        if prefill_s is None or step_s is None:
            prefill_s, step_s = self._measure_full(512, 8)
        timing = Timing(prefill_s, step_s)
        total = 0.0
        for unit, methods in todo:
            total += get_task(unit.task).estimate_seconds(unit, methods, self.config, timing)
        return total

    def _measure_full(self, length: int, steps: int) -> tuple[float, float]:
        ids = raw_passage(self.model.tokenizer, length + steps, self.config.split, 0)
        prompt, continuation = ids[:length], ids[length:]
        policy = self.policies[FULL].fresh()
        self.engine.prefill_ids(prompt[:32], policy.fresh())  # warm-up
        t0 = time.perf_counter()
        done = self.engine.prefill_ids(prompt, policy, spare=steps)
        t1 = time.perf_counter()
        for i, token in enumerate(continuation):
            self.engine.decode_step([done.cache], [policy], [token], [done.next_position + i])
        t2 = time.perf_counter()
        return t1 - t0, (t2 - t1) / steps


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
