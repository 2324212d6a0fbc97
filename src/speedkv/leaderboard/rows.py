"""A RULER leaderboard's rows: every method's score per task and on average, beside what it costs.

Rows come from the records of any number of runs: `speedkv eval --tasks ruler` (our methods,
with or without an adapter, question in view or not) and benchmarks/kvpress_peer.py (kvpress's
presses, in the same record shape). A row is one (method, adapter, setting, length); its
average is RULER's own, the mean of its 13 task scores, and is only given when every task has
samples. Its cost is the KV held at the first token and the TTFT, each against full attention
on the same prompts.

Settings: *query-aware* means the question is in view when the cache is made (RULER's prompt
as it is: the question follows the context); *query-agnostic* means the context is cached
first, without its question, as a document that later questions reuse.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from speedkv.evals import ruler
from speedkv.evals.report import summarise
from speedkv.evals.ruler import median_ttft_ratio

AWARE, AGNOSTIC = "aware", "agnostic"
Z95 = 1.96  # a normal 95 % interval
T_BELOW = 10  # tasks with fewer samples than this get Student's t instead of the normal
KV_MATCH = 0.01  # rows within this of each other's KV ratio hold the same share of the cache
SETTING_LABELS = {AWARE: "query-aware", AGNOSTIC: "query-agnostic"}
KVPRESS_NONE = "kvpress:none"  # kvpress's pipeline without a press: its engine's full attention

# names people know the methods by, for tables and plots
NAMES = {
    "full": "full attention",
    "speed": "SPEED",
    "pop": "POP",
    "swiftkv": "SwiftKV",
    "fastkv": "FastKV",
    "specprefill": "SpecPrefill",
    "gemfilter": "GemFilter",
    "snapkv": "SnapKV",
    "streamingllm": "StreamingLLM",
    "h2o": "H2O",
    "pyramidinfer": "PyramidInfer",
}
KVPRESS_NAMES = {
    "snapkv": "SnapKV",
    "expected_attention": "ExpectedAttention",
    "streaming_llm": "StreamingLLM",
    "tova": "TOVA",
    "knorm": "Knorm",
    "kvzip": "KVzip",
    "none": "no press",
}


@dataclass
class Row:
    """One method's RULER at one length, in one setting."""

    method: str  # the run's spec, e.g. speed:lcut=22,... or kvpress:snapkv,ratio=0.267,...
    engine: str  # speedkv or kvpress
    adapter: str | None
    setting: str  # AWARE or AGNOSTIC
    length: int
    scores: dict[str, float]  # task -> mean score, a fraction
    counts: dict[str, int]  # task -> samples
    kv_ratio: float
    ttft_ratio: float | None  # None: no sample timed on its own, and no quiet bench run
    ttft_source: str = "records"  # records (median per-sample ratio) or bench (quiet run)
    seconds: float = 0.0  # wall time of every sample, all tasks
    # per_sample: (task, sample) -> score; records: (task, sample) -> record; when kept
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def complete(self) -> bool:
        return all(self.counts.get(t, 0) > 0 for t in ruler.TASKS)

    @property
    def average(self) -> float | None:
        """RULER's average: the mean of the 13 task scores (None until every task has one)."""
        if not self.complete:
            return None
        return statistics.fmean(self.scores[t] for t in ruler.TASKS)

    @property
    def margin(self) -> float | None:
        """Half-width of a 95 % interval around the average, from each task's samples: a score
        in [0, 1] with mean s spreads by at most s(1 - s) (exactly that for right-or-wrong
        tasks), and the tasks' samples are drawn independently. None until every task has one."""
        if not self.complete:
            return None
        parts = [
            (self.scores[t] * (1 - self.scores[t]) / self.counts[t], self.counts[t])
            for t in ruler.TASKS
        ]
        return critical_value(parts) * math.sqrt(sum(v for v, _ in parts)) / len(ruler.TASKS)

    @property
    def min_samples(self) -> int:
        return min((self.counts.get(t, 0) for t in ruler.TASKS), default=0)

    @property
    def label(self) -> str:
        return method_label(self.method, self.engine) + (" + adapter" if self.adapter else "")


def critical_value(parts: list[tuple[float, int]]) -> float:
    """The 95 % two-sided critical value for a sum of independent task means, each given as
    (variance of its mean, samples): the normal's 1.96 where every task has at least `T_BELOW`
    samples, else Student's t with the Welch-Satterthwaite degrees of freedom of the sum (a
    task of one sample counts as one degree of freedom)."""
    if all(n >= T_BELOW for _, n in parts):
        return Z95
    total = sum(v for v, _ in parts)
    denominator = sum(v * v / max(1, n - 1) for v, n in parts)
    if total <= 0 or denominator <= 0:
        return Z95  # no spread at all: the margin is zero whatever the factor
    from scipy.stats import t as student_t

    return float(student_t.ppf(0.975, total * total / denominator))


def method_label(method: str, engine: str = "speedkv") -> str:
    """A short name: SPEED-22, SPEED-22 deep=64, SnapKV, kvpress SnapKV (KV 0.733), ..."""
    name, _, options = method.partition(":")
    opts = dict(o.split("=", 1) for o in options.split(",") if "=" in o)
    if engine == "kvpress":  # kvpress:<press>,ratio=...: rows at two ratios differ by KV kept
        press = options.split(",")[0]
        kept = f" (KV {1 - float(opts['ratio']):.3f})" if "ratio" in opts else ""
        return "kvpress " + KVPRESS_NAMES.get(press, press) + kept
    label = NAMES.get(name, name)
    if name == "speed":
        label += f"-{opts.get('lcut', '?')}"
        if opts.get("deep", "1") != "1":
            label += f" deep={opts['deep']}"
        if opts.get("anchors", "bos") != "bos":
            label += f" {opts['anchors']}"
    elif name in ("pop", "swiftkv"):
        label += f"-{opts.get('lcut', opts.get('k', '?'))}"
    elif name == "fastkv" and "tsp_rate" in opts:  # two FastKV rows differ by their TSP rate
        label += f" TSP {opts['tsp_rate']}"
    return label


def without_setting(method: str) -> str:
    """A spec without its `setting=` option: both settings of a method share a table row."""
    name, _, options = method.partition(":")
    kept = [o for o in options.split(",") if o and not o.startswith("setting=")]
    return name + (":" + ",".join(kept) if kept else "")


# -- reading runs ------------------------------------------------------------------------------
def read_run(directory: Path) -> tuple[dict, list[dict]]:
    """A run's header and its RULER records (a line cut short by a killed run is skipped)."""
    return read_records(directory / "records.jsonl")


def read_records(path: Path) -> tuple[dict, list[dict]]:
    """The header and RULER records of one records.jsonl, wherever it lies (see `read_run`)."""
    header: dict = {}
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "header" in item:
            header = item["header"]
        elif ruler.is_ruler(item.get("task", "")):
            records.append(item)
    return header, records


def rows_from_runs(
    directories: Iterable[Path],
    ttft: dict[tuple[str, int], float] | None = None,
    reference_only: Collection[Path] = (),
) -> list[Row]:
    """One row per (engine, adapter, setting, method, length) over all the runs; a sample
    recorded by several runs (parts of one sweep that overlap) counts once, its latest.
    `ttft` maps (method, length) to a TTFT ratio from a quiet benchmark run, which replaces
    the per-sample ratios of a sweep that shared the CPU. The no-press answers of the runs in
    `reference_only` are only the reference their own presses' ratios were taken against:
    another sweep's make the board's no-press row (answers made elsewhere can differ in
    bfloat16's last bits, and a row's samples must come from one place)."""
    groups: dict[tuple, dict[tuple, dict]] = {}
    references = {Path(d) for d in reference_only}
    for directory in directories:
        header, records = read_run(Path(directory))
        engine = header.get("engine") or header.get("peer") or "speedkv"
        adapter = header.get("adapter")
        reference = Path(directory) in references
        for r in records:
            if reference and without_setting(r["method"]) == KVPRESS_NONE:
                continue
            setting = r.get("setting", header.get("setting", AWARE))
            if engine == "speedkv" and r.get("prefill_shared"):  # question always in view;
                setting = AWARE  # speedkv eval before 2026-11-28 labelled these agnostic
            # (kvpress's shared prefill is the context's alone: its records name their setting)
            key = (engine, adapter, setting, without_setting(r["method"]), r["length"])
            groups.setdefault(key, {})[(r["task"], r["sample"])] = r
    rows = []
    for (engine, adapter, setting, method, length), by_sample in groups.items():
        # kvpress names its settings in the method (setting=...): the row's spec has none
        records = [{**r, "method": method} for r in by_sample.values()]
        tasks = [t for t in ruler.TASKS if any(r["task"] == t for r in records)]
        summary = summarise(records, [method], tasks)
        per_task = {s["task"]: s for s in summary if s["task"] != ruler.GROUP}
        row = Row(
            method=method,
            engine=engine,
            adapter=adapter,
            setting=setting,
            length=length,
            scores={t: s["score"] for t, s in per_task.items()},
            counts={t: s["n"] for t, s in per_task.items()},
            # a press that only masks what it drops (KVzip) is held at what it leaves unmasked,
            # the cache it stands for; for every other method the two are the same
            kv_ratio=statistics.fmean(r.get("kv_ratio_effective", r["kv_ratio"]) for r in records),
            ttft_ratio=median_ttft_ratio(records),
            seconds=sum(r.get("seconds", 0.0) for r in records),
            extra={
                "per_sample": {key: r["score"] for key, r in by_sample.items()},
                "records": by_sample,
            },
        )
        if ttft and (method, length) in ttft and engine == "speedkv":
            row.ttft_ratio, row.ttft_source = ttft[(method, length)], "bench"
        rows.append(row)
    return sorted(rows, key=_row_order)


def answers_by_machine(directories: Iterable[Path]) -> dict[str, tuple[int, float]]:
    """How many of the runs' answers each CPU made, and their summed wall time in seconds (a
    sweep may resume on another machine); answers from before records named their machine
    count as "not recorded". Most answers first."""
    counts: Counter[str] = Counter()
    seconds: Counter[str] = Counter()
    for directory in directories:
        for record in read_run(Path(directory))[1]:
            machine = record.get("machine") or "not recorded"
            counts[machine] += 1
            seconds[machine] += record.get("seconds", 0.0)
    return {machine: (n, seconds[machine]) for machine, n in counts.most_common()}


def _row_order(row: Row) -> tuple:
    average = row.average
    return (
        row.length,
        row.setting != AWARE,
        row.engine != "speedkv",
        row.adapter is not None,
        -(average if average is not None else -1.0),
        row.method,
    )
