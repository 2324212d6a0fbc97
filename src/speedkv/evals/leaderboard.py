"""RULER leaderboard: every method's score per task and on average, beside what it costs.

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
from speedkv.evals.report import median_ttft_ratio, ruler_score, summarise

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
    header: dict = {}
    records = []
    path = directory / "records.jsonl"
    for line in path.read_text().splitlines():
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


def bench_ttft(path: Path) -> dict[tuple[str, int], float]:
    """TTFT ratios against full from a `speedkv bench` results.json: (method, length) -> x."""
    data = json.loads(Path(path).read_text())
    return {(c["method"], int(c["length"])): float(c["ttft_ratio"]) for c in data["cells"]}


def published_bench_ttft(published: Iterable[Row]) -> dict[tuple[str, int], float]:
    """The quiet-bench TTFT ratios a published board's rows carry, as `bench_ttft` gives them:
    what a board rendered where its `ttft` sweep's results are not keeps for speedkv's rows."""
    return {
        (r.method, r.length): r.ttft_ratio
        for r in published
        if r.engine == "speedkv" and r.ttft_source == "bench" and r.ttft_ratio is not None
    }


# -- the Pareto front --------------------------------------------------------------------------
def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats: none has a lower (or equal) cost with a
    higher (or equal) score, one of the two strictly. Cost on x, score on y."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (x2 <= x and y2 >= y) and (x2 < x or y2 > y)
            for j, (x2, y2) in enumerate(points)
            if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def untrained_front(rows: list[Row], cost: str) -> list[int]:
    """Indices of `rows` on the Pareto front of RULER average against `cost` (kv_ratio or
    ttft_ratio), over the untrained rows only: a trained row is another model. Costs count to
    three decimals, so rows set to one budget tie instead of ranking by their rounding."""
    untrained = [
        i
        for i, r in enumerate(rows)
        if not r.adapter and r.average is not None and getattr(r, cost) is not None
    ]
    points = [(round(getattr(rows[i], cost), 3), rows[i].average) for i in untrained]
    return [untrained[j] for j in pareto_front(points)]


# -- tables ------------------------------------------------------------------------------------
def _pct(value: float | None) -> str:
    return "–" if value is None or math.isnan(value) else ruler_score(value)


def leaderboard_table(rows: list[Row], length: int) -> str:
    """The headline table at one length: a row per method and adapter, its average in each
    setting, KV and TTFT ratios; best-first within the untrained, trained and kvpress rows."""
    mine = [r for r in rows if r.length == length]
    # a method (one spec, one adapter) is ranked once every task has a sample in a setting;
    # an unranked one sharing a ranked one's label is named by its spec too
    ranked = {_key(r) for r in mine if r.average is not None}
    ranked_labels = {r.label for r in mine if _key(r) in ranked}
    partial_names = list(
        dict.fromkeys(
            f"{r.label} (`{_short_spec(r.method)}`)" if r.label in ranked_labels else r.label
            for r in sorted(mine, key=lambda r: r.method)
            if _key(r) not in ranked
        )
    )
    mine = [r for r in mine if _key(r) in ranked]
    keys = list(dict.fromkeys(_key(r) for r in mine))
    lines = [
        "| method | adapter | KV x | TTFT x | RULER avg ± 95 %, query-aware "
        "| RULER avg ± 95 %, query-agnostic | samples per task |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for engine, adapter, method in keys:
        both = {
            r.setting: r
            for r in mine
            if (r.engine, r.adapter, r.method) == (engine, adapter, method)
        }
        first = both.get(AWARE) or both[AGNOSTIC]
        samples = sorted({r.min_samples for r in both.values()})
        ttft = (
            "–"
            if first.ttft_ratio is None
            else f"{first.ttft_ratio:.3f}" + ("" if first.ttft_source == "bench" else "*")
        )
        lines.append(
            f"| {first.label} (`{_short_spec(method)}`) | {_adapter_cell(adapter)} "
            f"| {first.kv_ratio:.3f} | {ttft} "
            f"| {_with_margin(both.get(AWARE))} | {_with_margin(both.get(AGNOSTIC))} "
            f"| {'/'.join(str(s) for s in samples)} |"
        )
    if partial_names:
        lines.append(f"\nNot every task measured yet: {', '.join(partial_names)}.")
    return "\n".join(lines) + "\n"


def _with_margin(row: Row | None) -> str:
    if row is None or row.average is None:
        return "–"
    return f"{_pct(row.average)} ± {100 * row.margin:.1f}"


def difference(a: Row, b: Row) -> tuple[float, float, bool]:
    """a's average less b's, the 95 % margin of that difference, and whether it is paired.
    Paired where both rows kept their per-sample scores and share at least two samples in every
    task: each task's mean difference over the samples both answered, with its spread, which
    is far smaller than two rows' own spreads where the methods agree on most samples.
    Otherwise the two margins combined as independent."""
    mine, theirs = a.extra.get("per_sample"), b.extra.get("per_sample")
    if mine and theirs:
        by_task: dict[str, list[float]] = {}
        for key in mine.keys() & theirs.keys():
            by_task.setdefault(key[0], []).append(mine[key] - theirs[key])
        if all(len(by_task.get(t, ())) >= 2 for t in ruler.TASKS):
            tasks = len(ruler.TASKS)
            gap = sum(statistics.fmean(by_task[t]) for t in ruler.TASKS) / tasks
            parts = [
                (statistics.variance(by_task[t]) / len(by_task[t]), len(by_task[t]))
                for t in ruler.TASKS
            ]
            spread = sum(v for v, _ in parts)
            return gap, critical_value(parts) * math.sqrt(spread) / tasks, True
    return a.average - b.average, math.hypot(a.margin, b.margin), False


def equal_kv_table(rows: list[Row], length: int) -> str:
    """SPEED against every kvpress press that holds the same share of the cache, in each
    setting: both averages with their 95 % margins and the difference with its own (paired
    where both rows kept their samples, see `difference`). A difference counts as told apart
    when it exceeds its margin. Empty when no press matches."""
    ranked = [r for r in rows if r.length == length and r.average is not None]
    speed = [r for r in ranked if r.engine == "speedkv" and r.method.startswith("speed:")]
    lines = []
    for mine in sorted(
        speed, key=lambda r: (r.setting != AWARE, r.adapter is not None, r.kv_ratio)
    ):
        presses = [
            r
            for r in ranked
            if r.engine == "kvpress"
            and r.setting == mine.setting
            and abs(r.kv_ratio - mine.kv_ratio) <= KV_MATCH
        ]
        for press in sorted(presses, key=lambda r: -r.average):
            gap, noise, paired = difference(mine, press)
            gap, noise = 100 * gap, 100 * noise  # points
            verdict = (
                ("SPEED ahead" if gap > 0 else "SPEED behind")
                if abs(gap) > noise
                else "within the margins"
            ) + (" (paired)" if paired else "")
            lines.append(
                f"| {SETTING_LABELS[mine.setting]} | {mine.kv_ratio:.3f} | {mine.label} "
                f"| {_with_margin(mine)} | {press.label} | {_with_margin(press)} "
                f"| {gap:+.1f} ± {noise:.1f} | {verdict} |"
            )
    if not lines:
        return ""
    # the engines differ (bfloat16 kernels, prompt handling), so each side's own ceiling too
    ceilings = [
        f"{engine} {SETTING_LABELS[r.setting]} {_with_margin(r)}"
        for engine, method in (("speedkv", "full"), ("kvpress", KVPRESS_NONE))
        for r in ranked
        if r.engine == engine and r.method == method and not r.adapter
    ]
    head = [
        "| setting | KV x | SPEED row | its RULER avg | kvpress press | its RULER avg "
        "| difference, points | 95 % |",
        "|---|---:|---|---:|---|---:|---:|---|",
    ]
    ceiling = f"\nFull attention in each engine: {'; '.join(ceilings)}.\n" if ceilings else ""
    return "\n".join(head + lines) + "\n" + ceiling


def own_reference_table(directories: Iterable[Path]) -> str:
    """Each press of runs that answer their own no-press reference (the kvzip sweep) against
    that reference on the same samples, made on the same CPU in the same process: both averages,
    the paired difference with its 95 % margin, how many answers are word for word the
    reference's, and the median per-sample TTFT ratio on each CPU that made them (a sweep may
    resume on another machine). Empty without such runs."""
    rows = rows_from_runs(directories)
    references = {r.setting: r for r in rows if r.method == KVPRESS_NONE}
    lines = []
    for row in rows:
        own = references.get(row.setting)
        if row.method == KVPRESS_NONE or own is None or row.average is None:
            continue
        mine, theirs = row.extra["records"], own.extra["records"]
        pairs = [(mine[k], theirs[k]) for k in sorted(mine.keys() & theirs.keys())]
        same = sum(pressed["answer"] == reference["answer"] for pressed, reference in pairs)
        by_machine: dict[str, list[float]] = {}
        for pressed, _ in pairs:
            if pressed.get("ttft_ratio") is not None:
                machine = pressed.get("machine") or "CPU not recorded"
                by_machine.setdefault(machine, []).append(pressed["ttft_ratio"])
        ttft = "; ".join(
            f"{statistics.median(v):.1f} on {machine} ({len(v)})"
            for machine, v in sorted(by_machine.items(), key=lambda item: -len(item[1]))
        )
        gap, noise, paired = difference(row, own)
        lines.append(
            f"| {SETTING_LABELS[row.setting]} | {row.label} | {row.kv_ratio:.3f} "
            f"| {_with_margin(row)} | {_with_margin(own)} "
            f"| {100 * gap:+.1f} ± {100 * noise:.1f}{'' if paired else ' (unpaired)'} "
            f"| {same} of {len(pairs)} | {ttft or '-'} |"
        )
    if not lines:
        return ""
    head = [
        "| setting | press | KV x | its RULER avg | no press, same samples | difference, points "
        "| answers word for word the no-press ones | TTFT x, median per sample (samples) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    return "\n".join(head + lines) + "\n"


def _key(row: Row) -> tuple:
    """What makes a line of the leaderboard: both settings of one method share it."""
    return (row.engine, row.adapter, row.method)


def task_table(rows: list[Row], length: int, setting: str) -> str:
    """Per-task scores (percent) in one setting at one length."""
    mine = [r for r in rows if r.length == length and r.setting == setting]
    names = [ruler.ruler_name(t) for t in ruler.TASKS]
    lines = [
        "| method | adapter | " + " | ".join(names) + " | avg |",
        "|---|---|" + "---:|" * (len(names) + 1),
    ]
    for r in mine:
        cells = [_pct(r.scores.get(t)) if r.counts.get(t) else "–" for t in ruler.TASKS]
        lines.append(
            f"| {r.label} | {_adapter_cell(r.adapter)} | "
            + " | ".join(cells)
            + f" | {_pct(r.average)} |"
        )
    return "\n".join(lines) + "\n"


def _adapter_cell(adapter: str | None) -> str:
    return Path(adapter).name if adapter else "none"


def _short_spec(method: str) -> str:
    """The spec without options at their defaults that every row shares."""
    return method.replace(",selfonly=false", "")


# -- the plot ----------------------------------------------------------------------------------
def plot_pareto(rows: list[Row], length: int, path: Path, title: str = "") -> Path | None:
    """RULER average against KV ratio and against TTFT ratio (columns), one row of panels per
    setting; each panel joins its untrained Pareto front and names the points a reader looks
    for (the front, SPEED, full attention, the adapter rows); the others are left to the
    tables, so dozens of presses at one budget stay readable."""
    mine = [r for r in rows if r.length == length and r.average is not None]
    if not mine:
        return None
    from speedkv.evals.report import _pyplot

    most = max(r.min_samples for r in mine)  # rows measured on fewer are marked provisional
    settings = [s for s in (AWARE, AGNOSTIC) if any(r.setting == s for r in mine)]
    plt = _pyplot()
    fig, grid = plt.subplots(
        len(settings), 2, figsize=(12, 4.8 * len(settings)), sharey=True, squeeze=False
    )
    costs = (
        ("kv_ratio", "KV cache at the first token, x full"),
        ("ttft_ratio", "TTFT, x full (each engine against its own full attention)"),
    )
    for axes, setting in zip(grid, settings):
        for ax, (cost, xlabel) in zip(axes, costs):
            points = [r for r in mine if r.setting == setting and getattr(r, cost) is not None]
            _pareto_panel(ax, points, cost, most)
            ax.set_xlabel(xlabel)
            values = [getattr(r, cost) for r in points]
            if values and max(values) > 4 * min(values):  # one slow outlier squashes the rest
                ax.set_xscale("log")
            ax.set_title(SETTING_LABELS[setting], fontsize=9)
        axes[0].set_ylabel(f"RULER average at {length} tokens, %")
    grid[0][0].legend(fontsize=7, loc="best")  # where it covers the fewest points
    fig.suptitle(
        (title + "\n" if title else "")
        + "black edge: with a SPEED-aware adapter (off the front, which joins untrained rows); "
        "bars: 95 % margins; unnamed points are in the tables",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# marker, colour and legend entry of each kind of row
_KINDS = {
    "speed": ("*", "tab:red", "SPEED"),
    "speedkv": ("o", "tab:blue", "speedkv's other methods"),
    "kvpress": ("s", "tab:green", "kvpress presses"),
}


def _kind(row: Row) -> str:
    if row.engine == "kvpress":
        return "kvpress"
    return "speed" if row.method.startswith("speed") else "speedkv"


def _pareto_panel(ax, points: list[Row], cost: str, most: int) -> None:
    if not points:
        return
    xy = [(getattr(r, cost), 100 * r.average) for r in points]
    front = untrained_front(points, cost)
    ax.plot([xy[i][0] for i in front], [xy[i][1] for i in front], "-", color="grey",
            alpha=0.6, label="Pareto front (untrained rows)")  # fmt: skip
    seen: set[str] = set()
    labels: list[tuple[float, float, str]] = []
    for i, (r, (x, y)) in enumerate(zip(points, xy)):
        kind = _kind(r)
        marker, colour, legend = _KINDS[kind]
        ax.scatter(
            x, y, s=150 if kind == "speed" else 36, marker=marker, color=colour,
            edgecolors="black" if r.adapter else colour, linewidths=1.2 if r.adapter else 0.5,
            zorder=3, label=None if kind in seen else legend,
        )  # fmt: skip
        seen.add(kind)
        ax.errorbar(x, y, yerr=100 * r.margin, fmt="none", ecolor=colour, alpha=0.25, zorder=2)
        named = i in front or kind == "speed" or r.adapter or r.method in ("full", KVPRESS_NONE)
        if named:
            label = r.label if r.min_samples == most else f"{r.label} ({r.min_samples}/task)"
            labels.append((x, y, label))
    ax.grid(alpha=0.3)
    _place_labels(ax, labels)


def _place_labels(ax, labels: list[tuple[float, float, str]]) -> None:
    """Annotate each point, top to bottom, at the first of a few spots beside it (right, below
    right, left, below left, above) where its label covers no label placed before: points of
    one method in both settings, and rows at one budget, sit close together."""
    ax.figure.canvas.draw()  # fixes the limits and scales the transform below depends on
    scale = ax.figure.dpi / 72  # points to display pixels
    spots = [(4, 3, "left"), (4, -10, "left"), (-4, 3, "right"), (-4, -10, "right"),
             (4, 12, "left"), (-4, 12, "right")]  # fmt: skip
    placed: list[tuple[float, float, float, float]] = []  # label boxes, display pixels

    def box(px, py, dx, dy, align, width):
        left = px + dx * scale - (width if align == "right" else 0)
        return left, py + dy * scale, left + width, py + (dy + 7) * scale

    def free(b):
        return all(b[2] < q[0] or b[0] > q[2] or b[3] < q[1] or b[1] > q[3] for q in placed)

    for x, y, text in sorted(labels, key=lambda item: -item[1]):
        px, py = ax.transData.transform((x, y))
        width = len(text) * 6.5 * 0.55 * scale  # a label's width, near enough
        dx, dy, align = next((spot for spot in spots if free(box(px, py, *spot, width))), spots[0])
        placed.append(box(px, py, dx, dy, align, width))
        ax.annotate(
            text, (x, y), fontsize=6.5, xytext=(dx, dy), textcoords="offset points", ha=align
        )


def rows_from_json(items: list[dict]) -> list[Row]:
    """Rows from a leaderboard's results.json (`to_json`): its figures as published."""
    names = [f.name for f in Row.__dataclass_fields__.values() if f.name != "extra"]
    return [Row(**{name: item[name] for name in names if name in item}) for item in items]


def row_identity(row: Row) -> tuple:
    """One row of one setting at one length: the unit a newer run replaces."""
    return (row.engine, row.adapter, row.setting, row.method, row.length)


def with_published(rows: list[Row], published: list[Row]) -> tuple[list[Row], list[Row]]:
    """`rows` and each published row that none of them replaces (its runs are elsewhere: the
    records of a sweep finished on another machine), and the published rows so carried."""
    fresh = {row_identity(r) for r in rows}
    carried = [r for r in published if row_identity(r) not in fresh]
    return sorted(rows + carried, key=_row_order), carried


def to_json(rows: list[Row]) -> list[dict]:
    return [
        {
            "method": r.method,
            "label": r.label,
            "engine": r.engine,
            "adapter": r.adapter,
            "setting": r.setting,
            "length": r.length,
            "average": r.average,
            "scores": r.scores,
            "counts": r.counts,
            "kv_ratio": r.kv_ratio,
            "ttft_ratio": r.ttft_ratio,
            "ttft_source": r.ttft_source,
            "seconds": r.seconds,
        }
        for r in rows
    ]
