"""The evaluation tasks by name, their default sample counts, and option parsing."""

from __future__ import annotations

from speedkv.errors import UserError
from speedkv.evals import reuse, ruler, sanity
from speedkv.evals.needles import MAX_NEW_TOKENS as NEEDLE_NEW_TOKENS
from speedkv.evals.needles import NEEDLE_TASKS

TASKS = (*NEEDLE_TASKS, "fidelity", "sanity", reuse.TASK, *ruler.TASKS)
# how errors list them: RULER's as its group and its names
TASK_NAMES = ", ".join(
    [
        *(t for t in TASKS if not ruler.is_ruler(t)),
        f"ruler (or ruler/TASK: {', '.join(ruler.NAMES)})",
    ]
)
DESCRIPTIONS = {
    "niah": "single needle: a 5-digit pass key, asked back",
    "niah_multikey": "four pass keys for four named things; one asked",
    "niah_multivalue": "four pass keys for one thing; all four asked",
    "vt": "variable tracking: a chain of three assignments; every variable holding the value",
    "fidelity": "teacher-forced continuation of an essay: perplexity, top-1 agreement and KL "
    "against full",
    "sanity": "short instructions: greedy answer identical to full's",
    "reuse": "four planted facts, each asked over one cached document and with a fresh prefill",
    ruler.GROUP: "RULER's 13 tasks, generated and scored by NVIDIA's nvidia-long-context-eval",
}
# Samples per task and length when --samples does not say: sized so that the full docs/results.md
# sweep (17 methods, 2K and 4K) stays within about two hours on a 2-core CPU.
DEFAULT_N = {
    "niah": 10,
    "niah_multikey": 4,
    "niah_multivalue": 3,
    "vt": 3,
    "fidelity": 4,
    "sanity": len(sanity.PROMPTS),
    "reuse": 8,  # documents; each asks reuse.QUESTIONS questions
    # the floor for a published RULER table; 13 tasks at 4K then take about 20 minutes per
    # method on SmolLM2 and a 2-core CPU
    **{task: 20 for task in ruler.TASKS},
}
SHORT = 0  # the length recorded for sanity's short prompts (each has its own length)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)


def is_needle(task: str) -> bool:
    return task in NEEDLE_TASKS


def max_new_tokens(task: str) -> int:
    if ruler.is_ruler(task):
        return ruler.task_spec(task).tokens_to_generate
    if task == "sanity":
        return sanity.MAX_NEW_TOKENS
    if task == reuse.TASK:
        return reuse.MAX_NEW_TOKENS
    return NEEDLE_NEW_TOKENS.get(task, 0)


def records_per_run(task: str) -> int:
    """Records one method writes for one sample: a reuse document writes one per question."""
    return reuse.QUESTIONS if task == reuse.TASK else 1


def parse_tasks(text: str) -> list[str]:
    """Task names separated by commas; `ruler` stands for all 13 `ruler/...` tasks."""
    tasks = ruler.expand([t.strip() for t in text.split(",") if t.strip()])
    if not tasks:
        raise UserError(f"give at least one task; tasks: {TASK_NAMES}")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise UserError(f"unknown task '{unknown[0]}'; tasks: {TASK_NAMES}")
    return tasks


def parse_n(text: str | None, tasks: list[str]) -> dict[str, int]:
    """Samples per task: None (the defaults), one count for every task ('3'), or per task
    ('niah=10,fidelity=4'; tasks not named keep their default; 'ruler=20' sets every RULER
    task's)."""
    counts = {t: DEFAULT_N[t] for t in tasks}
    if text is None or not text.strip():
        return counts
    text = text.strip()
    if "=" not in text:
        return {t: _count(text, text) for t in tasks}
    for part in text.split(","):
        task, eq, value = (s.strip() for s in part.partition("="))
        if not eq or (task not in TASKS and task != ruler.GROUP):
            raise UserError(
                f"--samples must be a count or task=count pairs separated by commas, got '{text}'"
            )
        for name in ruler.expand([task]):
            if name in counts:
                counts[name] = _count(value, text)
    return counts


def _count(value: str, text: str) -> int:
    try:
        n = int(value)
    except ValueError as err:
        raise UserError(f"--samples must be a whole number of samples, got '{text}'") from err
    if n < 1:
        raise UserError(f"--samples must be at least 1 sample, got '{text}'")
    return n


def parse_depths(text: str) -> list[float]:
    try:
        depths = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise UserError(f"depths must be fractions between 0 and 1, got '{text}'") from err
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise UserError(f"depths must be fractions between 0 and 1, got '{text}'")
    return sorted(set(depths))
