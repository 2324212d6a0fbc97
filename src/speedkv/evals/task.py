"""The evaluation task interface: what `speedkv eval` asks of a task, and what it offers one.

A `Task` checks the settings it owns, refuses a length it cannot run at, makes its units (one
sample at one length), runs every pending method on a unit, costs its runs, summarises its
records and renders its section of the report. The runner (runner.py) and the report
(report.py) walk the registry (tasks.py) and name no task. Each task lives in one module with
the code that builds and scores its samples:

    needles.py   niah, niah_multikey, niah_multivalue, vt
    fidelity.py  fidelity          sanity.py  sanity          reuse.py  reuse
    ruler.py     ruler/... (RULER's 13 tasks) and their group, `ruler`

A `TaskGroup` is a set of tasks reported together (RULER: a table of its tasks and their
average); `--tasks` and `--samples` take its name for all of them.

Adding a task is one module with a `Task` subclass, plus one `register(...)` line in tasks.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from speedkv.core.engine import Engine, Generation
from speedkv.core.policy import Policy
from speedkv.core.prefix import CachedPrefix
from speedkv.core.registry import MethodSpec
from speedkv.errors import UserError
from speedkv.evals.render import mean, metric_table, percent
from speedkv.hf.loading import LoadedModel
from speedkv.hf.text import EncodedPrompt

FULL = "full"  # every task's reference method: it runs first on every sample
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
DEFAULT_CONTINUATION_TOKENS = 64


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
    fidelity_tokens: int = DEFAULT_CONTINUATION_TOKENS
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


def base_record(method: str, unit: Unit, prompt_tokens: int) -> dict:
    """The fields every record opens with."""
    return {
        "method": method,
        "task": unit.task,
        "length": unit.length,
        "sample": unit.index,
        "prompt_tokens": prompt_tokens,
    }


def record_key(record: dict) -> tuple[str, str, int, int]:
    return (record["method"], record["task"], record["length"], record["sample"])


class Services(Protocol):
    """What the runner offers a task: the models, engines and methods of the sweep."""

    model: LoadedModel
    config: EvalConfig
    engine: Engine
    reference_engine: Engine  # whose full attention is the yardstick (`engine` by default)
    reference_full: Policy  # full attention for the reference model
    policies: dict[str, Policy]  # every method of the sweep by its canonical spec
    methods: list[str]  # the canonical specs, full first
    samples: dict[tuple[str, int], Any]  # what a task's `prepare` made, by (task, length)

    def generate(
        self, method: str, prompt: EncodedPrompt, new: int, prefix: CachedPrefix | None = None
    ) -> Generation:
        """The method's greedy answer to `prompt` (from `prefix`'s cache when given)."""
        ...

    def shared_prefixes(
        self, prompt: EncodedPrompt, methods: list[str]
    ) -> tuple[dict[str, CachedPrefix], float]:
        """With `--shared-prefill`, the cache each method that can take one starts from, and
        each one's share of the seconds it took; empty without."""
        ...


def _prefill_cost(n: int) -> float:
    return n * (1 + n / 2560)  # fitted to SmolLM2 bf16 prefill at 2K and 8K on a 2-core CPU


def _step_cost(n: int) -> float:
    return 1 + n / 1024  # a fixed cost per step, plus reading a cache that grows


@dataclass(frozen=True)
class Timing:
    """Full attention's prefill and decode-step seconds on a 512-token prompt, measured on
    this machine; `run_seconds` scales them to other lengths."""

    prefill_s: float
    step_s: float

    def run_seconds(self, length: int, new: int, prefills: int = 1, answers: int = 1) -> float:
        """One method's run: `prefills` prefills of a `length`-token prompt and `answers`
        answers of `new` tokens each (linear work plus attention that grows with the prompt)."""
        per = prefills * self.prefill_s * _prefill_cost(length) / _prefill_cost(512)
        per += answers * new * self.step_s * _step_cost(length) / _step_cost(512)
        return per


@dataclass(frozen=True)
class Table:
    """One table of a task's report section: a summary key per method and length."""

    title: str
    key: str
    format: Callable[[Any], str]


def _same(value: float) -> float:
    return value


@dataclass(frozen=True)
class Column:
    """A task's number in the overview (and in tables across runs): summary key, column
    label, format, and its colour in the overview plot (0 red .. 1 green)."""

    key: str
    label: str
    format: Callable[[Any], str] = percent
    colour: Callable[[float], float] = _same


class Task:
    """One evaluation task. Subclasses set the class attributes and override `run`; every
    other hook has a default that fits a task answering each sample once.

    Hooks called once per kind (one call per Task subclass, on its first registered task,
    with everything of that kind) are marked so: RULER's tasks generate their samples
    together, the needle tasks share one heatmap per method.
    """

    name: str = ""
    description: str = ""  # one line, the title of its report section
    default_samples: int = 1  # samples per length when --samples does not say
    max_new_tokens: int = 0  # tokens each answer may take
    records_per_run: int = 1  # records one method writes for one sample
    uses_lengths: bool = True  # False: its prompts have their own lengths (recorded as 0)
    group: str | None = None  # the TaskGroup it is reported in, if any
    # how it is built and scored, for the results page (markdown); tasks in no group are
    # explained together, in registry order, once any of them ran
    methodology: str = ""
    tables_shown: tuple[Table, ...] = (Table("score", "score", percent),)
    headline: Column | None = None  # None: its score, labelled with its name
    compared: tuple[Column, ...] | None = None  # across runs; None: the headline
    figures: dict[str, str] = {}  # plots it writes that a results page shows: file -> alt text

    # -- settings and plan ---------------------------------------------------------------------
    def check_settings(self, ctx: Services) -> None:
        """Refuse (UserError, one sentence) a setting this kind of task owns. Once per kind, in
        every run whether or not the task is in it: every setting is part of a run's header."""

    def validate(self, ctx: Services, length: int) -> None:
        """Refuse a prompt length this task cannot run at (called for each length, once the
        length is known to fit the model). By default its answer must fit after the prompt."""
        self.check_room(ctx, length, self.max_new_tokens)

    def check_room(self, ctx: Services, length: int, new: int) -> None:
        context = ctx.model.shape.max_positions
        if length + new > context:
            raise UserError(
                f"length {length} leaves no room for task {self.name}'s {new} new tokens "
                f"within the model's context of {context}"
            )

    def header(self, config: EvalConfig) -> dict:
        """Entries for the records' header when the task is in the run (a resumed run must
        match them)."""
        return {}

    def units(self, config: EvalConfig) -> list[Unit]:
        """Its samples: config.n[name] at every length."""
        count = config.n[self.name]
        return [Unit(self.name, length, i) for length in config.lengths for i in range(count)]

    def prepare(self, ctx: Services, units: list[Unit], log: Callable | None = None) -> None:
        """Once per kind, before the sweep: make what the pending units need (into
        `ctx.samples`) and refuse what cannot run."""

    # -- running -------------------------------------------------------------------------------
    def run(
        self, ctx: Services, unit: Unit, methods: list[str], records: list[dict]
    ) -> Iterator[dict]:
        """The records of `methods` on one sample, each as soon as it is done (`full`'s first
        when it is pending; `records` holds those already made, full's among them)."""
        raise NotImplementedError(f"task {self.name} does not say how it runs")

    def estimate_seconds(
        self, unit: Unit, methods: list[str], config: EvalConfig, timing: Timing
    ) -> float:
        """Seconds `methods` should take on `unit`, each costed as full attention."""
        return len(methods) * timing.run_seconds(unit.length, self.max_new_tokens)

    # -- reporting -----------------------------------------------------------------------------
    def summary(self, method: str, length: int, records: list[dict]) -> dict:
        """One summary row: `score` and `n` (None and 0 without records), then its own."""
        return {
            "method": method,
            "task": self.name,
            "length": length,
            "score": mean(r["score"] for r in records),
            "n": len(records),
            "prompt_tokens_mean": mean(r["prompt_tokens"] for r in records),
            **self.summarise(records),
        }

    def summarise(self, records: list[dict]) -> dict:
        """Its own metrics over one method's records at one length (None where no record)."""
        return {}

    def tables(self, summary: list[dict], level: str = "##") -> str:
        """Its section of tables.md and the results page."""
        parts = [f"{level} {self.name}: {self.description}\n"]
        for table in self.tables_shown:
            parts.append(
                f"{table.title} (samples in brackets):\n\n"
                + metric_table(summary, self.name, table.key, table.format)
            )
        return "\n".join(parts)

    def overview(self) -> Column:
        return self.headline or Column("score", self.name)

    def comparison(self) -> tuple[Column, ...]:
        return self.compared or (self.overview(),)

    def miss(self, record: dict) -> tuple[list[str], str] | None:
        """For misses.md: the expected values and the answer's cell when `record` missed."""
        return None

    def plot(self, result: dict, out: Path) -> list[Path]:
        """Once per kind: the plots it writes into `out`."""
        return []


class TaskGroup:
    """Tasks reported together: one section of tables, summary rows of their own (task =
    the group's name), and one column in the overview."""

    name: str = ""
    title: str = ""  # how a page names it
    description: str = ""
    members: tuple[str, ...] = ()
    methodology: str = ""
    headline: Column | None = None

    def listing(self) -> str:
        """How error messages list it."""
        return self.name

    def summary_rows(
        self, rows: list[dict], groups: dict[tuple[str, str, int], list[dict]], methods: list[str]
    ) -> list[dict]:
        """Its rows, from its members' rows and their records, by (task, method, length)."""
        return []

    def tables(self, summary: list[dict], level: str = "##") -> str:
        return ""

    def overview(self) -> Column:
        return self.headline or Column("score", self.name)

    def comparison(self) -> tuple[Column, ...]:
        return (self.overview(),)
