"""What each leaderboard measures (a Plan per model and length) and the sweeps that measure it.

--model and --length pick a plan (PLANS): SmolLM2 at 4K has every row and both settings;
SmolLM2 at 8K (8064 tokens: every prompt with its answer in SmolLM2's 8192) and Qwen2.5-0.5B at
4K and 16K check the main rows (full, SPEED with and without its adapter, SnapKV or kvpress's
best presses), with fewer samples where a prefill costs more.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from speedkv.evals import ruler
from speedkv.leaderboard.published import rows_from_json, with_published
from speedkv.leaderboard.repo import BOARDS
from speedkv.leaderboard.rows import Row, rows_from_runs

# kvpress's presses at SPEED's KV ratio; KVzip is a sweep of its own: it replays the context
# to score it, about five prefills a sample
KVPRESS_PRESSES = "snapkv,expected_attention,streaming_llm,tova,knorm"
KVZIP = "kvzip"
# every board in bfloat16, kvpress's rows too, so no row depends on the CPU that made it
# (speedkv's `auto` is float32 on a CPU without bf16 matrix instructions)
DTYPE = "bfloat16"


@dataclass
class Sweep:
    name: str
    methods: list[str]
    args: list[str] = field(default_factory=list)
    peer: bool = False  # kvpress, not speedkv eval
    # its press=None answers are only its own ratios' reference; the `kvpress` sweep's make the
    # board's no-press row
    reference_only: bool = False
    samples: int | None = None  # per task, where not the plan's


@dataclass(frozen=True)
class Plan:
    """What the leaderboard measures for one model at one length. deep=1 is spelled out in
    SPEED's rows: the paper's suffix, and the one the shipped adapters were trained with."""

    kv: float  # SPEED's KV ratio at its main cutoff: the budget every peer gets
    speed: tuple[str, ...]  # SPEED's untrained rows
    peers: tuple[str, ...]  # speedkv's other methods, at `kv`
    adapter: str  # the shipped SPEED-aware adapter for this model
    trained: tuple[str, ...]  # rows run with the adapter merged
    agnostic: tuple[str, ...]  # rows run with the context cached before the question
    presses: str  # kvpress's presses, at `kv` and at each of `more_kv`
    samples: int  # per task
    kvzip: bool = False
    kvzip_samples: int | None = None  # per task, where fewer than `samples` (its replays cost)
    more_kv: tuple[float, ...] = ()  # other KV ratios SPEED reaches here, for kvpress too
    # full and SPEED start from one full prefill per sample (speedkv eval --shared-prefill):
    # the same answers for about one prefill a sample; SPEED's TTFT then comes from `ttft`
    shared_prefill: bool = True

    def kvpress_settings(self) -> str:
        """kvpress's --settings: the settings speedkv's rows have in this plan, so every press
        is compared in a setting SPEED was measured in (a plan without query-agnostic rows
        spends no prefills on kvpress's)."""
        return "aware,agnostic" if self.agnostic else "aware"

    def compression_ratios(self) -> str:
        """kvpress's --ratios: the share of entries each press removes, one per KV ratio."""
        return ",".join(f"{1 - kv:.3f}" for kv in (self.kv, *self.more_kv))


def smollm2_peers(kv: float) -> tuple[str, ...]:
    return (
        f"snapkv:retain={kv},gqa=true",  # one copy per KV head: equal KV (gqa=false keeps 3)
        f"streamingllm:window={kv}",
        "pop:lcut=22",
        "swiftkv:k=22",
        f"fastkv:retain={kv}",  # the authors' TSP rate 0.2 caps the upper layers: KV ~0.47
        f"fastkv:tsp_rate={kv},retain={kv}",  # the same KV as SPEED
        f"specprefill:keep={kv}",
        f"gemfilter:retain={kv}",
        f"h2o:heavy={kv / 2:.4f},recent={kv / 2:.4f}",
        "pyramidinfer",
    )


SMOLLM2_8K = ("smollm2-135m", 8192 - ruler.longest_answer())  # 8064: room for every answer
SMOLLM2_KV = 0.733  # SPEED-22 on SmolLM2: 22 of 30 layers hold the prompt
SMOLLM2_KV26 = 0.867  # SPEED-26: 26 of 30
SPEED22 = "speed:lcut=22,anchors=bos,deep=1"
SPEED26 = "speed:lcut=26,anchors=bos,deep=1"
SPEED22_DEEP64 = "speed:lcut=22,anchors=bos,deep=64"  # speedkv's default deep suffix
SMOLLM2_ADAPTER = "adapters/smollm2-135m-speed22-bos"
QWEN_SPEED18 = "speed:lcut=18,anchors=sink:4,deep=1"  # 18 of 24 layers, the adapter's cut
QWEN_ADAPTER = "adapters/qwen2.5-coder-0.5b-speed18-sink4"

QWEN_PLAN = Plan(
    kv=0.75,
    speed=(QWEN_SPEED18,),
    peers=(),
    adapter=QWEN_ADAPTER,
    trained=("full", QWEN_SPEED18),
    agnostic=(),
    presses="best:1",  # the SmolLM2 4K board's best press (best_presses; --presses overrides)
    samples=10,
)
# KVzip, the 4K board's best press but about five prefills a sample, checked on the second
# model at 4K on half the samples: against its own no-press answers, as on SmolLM2
QWEN_PLAN_4K = dataclasses.replace(QWEN_PLAN, kvzip=True, kvzip_samples=5)

# the main board, whose kvpress sweep names the best presses for the later plans
BOARD_4K = BOARDS / "smollm2-135m-4096"

PLANS: dict[tuple[str, int], Plan] = {
    ("smollm2-135m", 4096): Plan(
        kv=SMOLLM2_KV,
        speed=(SPEED22, SPEED26, SPEED22_DEEP64),
        peers=smollm2_peers(SMOLLM2_KV),
        adapter=SMOLLM2_ADAPTER,
        trained=("full", SPEED22, SPEED22_DEEP64),
        agnostic=("full", SPEED22, SPEED26, SPEED22_DEEP64),
        presses=KVPRESS_PRESSES,
        samples=20,
        kvzip=True,
        more_kv=(SMOLLM2_KV26,),  # kvpress also at SPEED-26's ratio
        shared_prefill=False,  # measured before the sweeps could share one
    ),
    # the 8K check: SPEED, its adapter and SnapKV; the 4K board's two best kvpress presses. At
    # 8192 - 128: SmolLM2's context is 8192, and RULER fits its text to the length (fwe all of
    # it, then 50 answer tokens), so at 8192 fwe's prompt and answer take 8257 with the template
    SMOLLM2_8K: Plan(
        kv=SMOLLM2_KV,
        speed=(SPEED22, SPEED22_DEEP64),
        peers=(f"snapkv:retain={SMOLLM2_KV},gqa=true",),
        adapter=SMOLLM2_ADAPTER,
        trained=("full", SPEED22),
        agnostic=(),
        presses="best:2",
        samples=10,  # an 8K prefill costs about twice a 4K one
        kvzip=True,  # the 4K board's best press, a sweep of its own (not among best:2)
        kvzip_samples=3,  # about 4 minutes a sample on one core at 8K: its replays cost
    ),
    # Qwen2.5-0.5B: a prefill of 4K tokens is about four times SmolLM2's, of 16K about twenty
    # times, so fewer samples a task
    ("qwen2.5-coder-0.5b", 4096): QWEN_PLAN_4K,
    ("qwen2.5-coder-0.5b", 16384): dataclasses.replace(QWEN_PLAN, samples=4),
}


def best_presses(work: Path, n: int, published: Path = BOARD_4K / "results.json") -> str:
    """kvpress's `n` best presses on the SmolLM2 4K board (its `kvpress` sweep under `work`, and
    the published board's rows where its runs are not there): by RULER average over both
    settings at SPEED-22's KV ratio. Refuses until every press has every task at the board's
    samples: a choice from part of the tasks would be another one."""
    board = PLANS[("smollm2-135m", 4096)]
    ratio = board.compression_ratios().split(",")[0]
    dirs = sorted(
        p.parent for p in (work / "smollm2-135m" / "4096").glob("kvpress-*/records.jsonl")
    )
    on_record = rows_from_json(json.loads(published.read_text())) if published.exists() else []
    rows, _ = with_published(rows_from_runs(dirs), on_record)
    expected = set(split_commas(board.presses))
    rows = [  # the `kvpress` sweep's presses (KVzip, a sweep of its own, is not among them)
        r
        for r in rows
        if r.method.startswith("kvpress:")
        and f"ratio={float(ratio):g}" in r.method
        and press_of(r) in expected
    ]
    ready = [r for r in rows if r.average is not None and r.min_samples >= board.samples]
    names = {press_of(r) for r in rows}
    if not (len(ready) == len(rows) == 2 * len(expected) and names == expected):
        raise SystemExit(
            "the SmolLM2 4K board's kvpress sweep is not complete, so its best presses are not "
            "known yet: run `speedkv leaderboard run kvpress` first, or name the "
            "presses with --presses"
        )
    by_press: dict[str, list[float]] = {}
    for r in ready:
        by_press.setdefault(press_of(r), []).append(r.average)
    ranked = sorted(by_press, key=lambda press: -sum(by_press[press]) / 2)
    return ",".join(ranked[:n])


def press_of(row: Row) -> str:
    """The press of a kvpress row (`kvpress:<press>,ratio=...`)."""
    return row.method.split(":")[1].split(",")[0]


def sweeps(plan: Plan) -> dict[str, Sweep]:
    """The sweeps of one plan (a plan without agnostic rows has no agnostic sweep)."""
    shared = ["--shared-prefill"] if plan.shared_prefill else []
    out = {
        "base": Sweep("base", ["full", *plan.speed, *plan.peers], shared),
        "adapter": Sweep("adapter", list(plan.trained), ["--adapter", plan.adapter, *shared]),
        "agnostic": Sweep("agnostic", list(plan.agnostic), ["--query-agnostic"]),
        "kvpress": Sweep("kvpress", [plan.presses], peer=True),
        "kvzip": Sweep(
            "kvzip", [KVZIP], peer=True, reference_only=True, samples=plan.kvzip_samples
        ),
    }
    if not plan.agnostic:
        del out["agnostic"]
    if not plan.kvzip:
        del out["kvzip"]
    return out


def task_parts(jobs: int) -> list[list[str]]:
    """RULER's tasks in `jobs` runs of consecutive tasks, in RULER's order (a stopped sweep
    resumes only with the same groups, so they never change for a given N)."""
    size = -(-len(ruler.TASKS) // jobs)
    return [list(ruler.TASKS[i : i + size]) for i in range(0, len(ruler.TASKS), size)]


def split_commas(text: str) -> list[str]:
    """The items of a ','-separated list, stripped, empty ones dropped (as the CLI reads them)."""
    return [item.strip() for item in text.split(",") if item.strip()]
