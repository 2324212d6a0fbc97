"""The task registry: every evaluation task by name (the interface is task.py), the groups
that stand for several, and parsing of the options that name them.

The built-in tasks register below, in the order errors and pages list them; a new task is a
module with a `Task` subclass and one `register(...)` line here.
"""

from __future__ import annotations

from dataclasses import replace

from speedkv.errors import UserError
from speedkv.evals import fidelity, needles, reuse, ruler, sanity
from speedkv.evals.task import EvalConfig, Task, TaskGroup

# -- registry -----------------------------------------------------------------------------------
TASKS: dict[str, Task] = {}
GROUPS: dict[str, TaskGroup] = {}


def register(task: Task) -> Task:
    """Add a task under its name (the last registration of a name wins)."""
    if not task.name or task.name in GROUPS:
        raise ValueError(f"a task needs a name of its own, got '{task.name}'")
    TASKS[task.name] = task
    return task


def register_group(group: TaskGroup) -> TaskGroup:
    GROUPS[group.name] = group
    return group


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise UserError(f"unknown task '{name}'; tasks: {listing()}")
    return TASKS[name]


def task_names() -> list[str]:
    return list(TASKS)


def kinds() -> list[Task]:
    """One task of each kind (Task subclass), in registry order: whom once-per-kind hooks
    (check_settings, prepare, plot) are called on."""
    first: dict[type, Task] = {}
    for task in TASKS.values():
        first.setdefault(type(task), task)
    return list(first.values())


def group_of(name: str) -> str | None:
    """The group a task is reported in (None for its own section, or an unknown name)."""
    task = TASKS.get(name)
    return None if task is None else task.group


def reporter(name: str) -> Task | TaskGroup:
    """Whoever renders summary rows of `name`: a task, or a group's own rows."""
    return GROUPS[name] if name in GROUPS else get_task(name)


def records_per_run(name: str) -> int:
    """Records one method writes for one sample (a reuse document: one per question)."""
    task = TASKS.get(name)
    return 1 if task is None else task.records_per_run


def listing() -> str:
    """How errors list the tasks: those in no group, then each group as its name."""
    own = [name for name, task in TASKS.items() if task.group is None]
    return ", ".join([*own, *(group.listing() for group in GROUPS.values())])


def expand(names: list[str]) -> list[str]:
    """A group's name stands for its tasks, in the group's order."""
    out: list[str] = []
    for name in names:
        out += list(GROUPS[name].members) if name in GROUPS else [name]
    return list(dict.fromkeys(out))


def expand_groups(config: EvalConfig) -> EvalConfig:
    """A group's name in the tasks, or as a sample count, stands for each of its tasks (as on
    the command line); a task's own count wins."""
    named = [g for g in GROUPS.values() if g.name in config.tasks or g.name in config.n]
    if not named:
        return config
    tasks = expand(config.tasks)
    n = {t: count for t, count in config.n.items() if t not in GROUPS}
    for group in named:
        if group.name in config.n:
            for task in tasks:
                if task in group.members:
                    n.setdefault(task, config.n[group.name])
    return replace(config, tasks=tasks, n=n)


# -- the built-in tasks -------------------------------------------------------------------------
for _task in needles.NEEDLES:
    register(_task)
register(fidelity.FIDELITY)
register(sanity.SANITY)
register(reuse.REUSE)
for _task in ruler.RULER_TASKS:
    register(_task)
register_group(ruler.RULER)

# Samples per task and length when --samples does not say (each task's `default_samples`):
# sized so that the full docs/results.md sweep (17 methods, 2K and 4K) stays within about two
# hours on a 2-core CPU.
DEFAULT_N = {name: task.default_samples for name, task in TASKS.items()}


# -- options ------------------------------------------------------------------------------------
def parse_tasks(text: str) -> list[str]:
    """Task names separated by commas; a group's name stands for its tasks."""
    tasks = expand([t.strip() for t in text.split(",") if t.strip()])
    if not tasks:
        raise UserError(f"give at least one task; tasks: {listing()}")
    for task in tasks:
        get_task(task)  # unknown names are refused
    return tasks


def parse_n(text: str | None, tasks: list[str]) -> dict[str, int]:
    """Samples per task: None (the defaults), one count for every task ('3'), or per task
    ('niah=10,fidelity=4'; tasks not named keep their default; a group's name, 'ruler=20',
    sets each of its tasks')."""
    counts = {t: get_task(t).default_samples for t in tasks}
    if text is None or not text.strip():
        return counts
    text = text.strip()
    if "=" not in text:
        return {t: _count(text, text) for t in tasks}
    for part in text.split(","):
        task, eq, value = (s.strip() for s in part.partition("="))
        if not eq or (task not in TASKS and task not in GROUPS):
            raise UserError(
                f"--samples must be a count or task=count pairs separated by commas, got '{text}'"
            )
        for name in expand([task]):
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
