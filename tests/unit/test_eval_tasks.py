"""The evaluation task registry: every registered task checked through the `Task` interface
(as every method is through its degenerate specs), and a new task added in a few lines and
run end to end: a `Task` subclass and its `register(...)`, nothing else."""

from __future__ import annotations

import ast
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from speedkv.errors import UserError
from speedkv.evals import report, runner
from speedkv.evals.runner import EvalRunner
from speedkv.evals.task import EvalConfig, Services, Task, Timing, Unit, base_record
from speedkv.evals.tasks import GROUPS, TASKS, get_task, parse_n, parse_tasks, register
from speedkv.hf.text import encode_prompt

# tiny models are latency-bound: one thread avoids contention on a shared CPU
pytestmark = pytest.mark.usefixtures("one_thread")

RULER_EXTRA = all(
    importlib.util.find_spec(m) is not None for m in ("long_context_eval", "nltk", "punkt")
)


def needs_package(name: str) -> None:
    """RULER's tasks read their answer budgets from the package (the speedkv[ruler] extra)."""
    if TASKS[name].group is not None and not RULER_EXTRA:
        pytest.skip("the speedkv[ruler] extra is not installed")


def tiny_config(name: str, **overrides) -> EvalConfig:
    """One sample of `name` at a length it accepts on the tiny word model (1024 positions)."""
    length = 1024 if TASKS[name].group is not None else 420  # RULER generates from 1024
    values = dict(
        model="tiny-words", methods=["full"], tasks=[name], lengths=[length], n={name: 1},
        fidelity_tokens=6,
    )  # fmt: skip
    return EvalConfig(**(values | overrides))


def one_sentence(message: str) -> bool:
    return "\n" not in message and "Traceback" not in message and len(message) < 400


# -- every registered task ------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(TASKS))
def test_every_task_refuses_a_bad_config_in_one_sentence(name, word_model, tmp_path):
    with pytest.raises(UserError) as refused:
        EvalRunner(word_model, tiny_config(name, n={name: 0}), tmp_path)
    assert one_sentence(str(refused.value)) and name in str(refused.value)
    if not get_task(name).uses_lengths:
        return
    # too short for its samples, or no room for its answer in the model's context
    messages = []
    for length in (8, word_model.shape.max_positions):
        try:
            EvalRunner(word_model, tiny_config(name, lengths=[length]), tmp_path)
        except UserError as e:
            messages.append(str(e))
    assert messages, f"task {name} accepted lengths 8 and the model's whole context"
    assert all(one_sentence(m) and f"task {name}" in m for m in messages), messages


@pytest.mark.parametrize("name", list(TASKS))
def test_every_task_plans_costs_and_summarises(name):
    task = get_task(name)
    assert task.name == name and task.description and task.default_samples >= 1
    config = tiny_config(name)
    units = task.units(config)
    assert units and all(isinstance(u, Unit) and u.task == name for u in units)
    needs_package(name)
    seconds = task.estimate_seconds(units[0], ["full", "speed"], config, Timing(0.01, 0.001))
    assert seconds > 0
    # a summary of no records: the row's fields, each empty
    row = task.summary("full", units[0].length, [])
    json.dumps(row)
    assert (row["method"], row["task"], row["n"], row["score"]) == ("full", name, 0, None)
    own = {k: v for k, v in row.items() if k not in ("method", "task", "length")}
    assert all(value in (None, 0, {}) for value in own.values()), own
    section = task.tables([])
    assert section.startswith(f"## {name}: {task.description}\n")


@pytest.mark.parametrize("name", list(GROUPS))
def test_every_group_names_registered_tasks_that_name_it(name):
    group = GROUPS[name]
    assert group.members and group.title and group.description
    assert all(TASKS[member].group == name for member in group.members)
    assert parse_tasks(name) == list(group.members)
    assert group.summary_rows([], {}, ["full"]) == []


def test_the_runner_and_the_report_name_no_task():
    """Every task is reached through the registry: no task's or group's name is a string in
    runner.py or report.py."""
    names = set(TASKS) | set(GROUPS)
    for module in (runner, report):
        tree = ast.parse(Path(module.__file__).read_text())
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
        assert not strings & names, f"{module.__name__} names {sorted(strings & names)}"


# -- a new task ---------------------------------------------------------------------------------
WORDS = ("apple", "river", "stone")


class Echo(Task):
    """A word asked back: each method's greedy answer to one short instruction, scored by
    whether the word is in it. The whole of a new task: this class and `register(Echo())`."""

    name = "echo"
    description = "a word asked back"
    max_new_tokens = 4

    def run(
        self, ctx: Services, unit: Unit, methods: list[str], records: list[dict]
    ) -> Iterator[dict]:
        word = WORDS[unit.index % len(WORDS)]
        prompt = encode_prompt(ctx.model.tokenizer, f"Say the word {word}.")
        for method in methods:
            g = ctx.generate(method, prompt, self.max_new_tokens)
            yield {
                **base_record(method, unit, len(prompt.ids)),
                "answer": g.text,
                "score": float(word in g.text.lower()),
            }


@pytest.fixture
def echo() -> Iterator[Task]:
    task = register(Echo())
    yield task
    del TASKS[task.name]


def test_a_new_task_runs_end_to_end(echo, word_model, tmp_path, monkeypatch):
    assert parse_tasks("echo,sanity") == ["echo", "sanity"]
    assert parse_n(None, ["echo"]) == {"echo": 1}
    speed = "speed:lcut=2,anchors=bos,deep=1"
    config = EvalConfig(
        model="tiny-words", methods=["full", speed], tasks=["echo", "sanity"], lengths=[64],
        n={"echo": 2, "sanity": 1},
    )  # fmt: skip
    result = EvalRunner(word_model, config, tmp_path).run(progress=False, plots=False)
    records = [r for r in result["records"] if r["task"] == "echo"]
    assert [(r["method"], r["sample"]) for r in records] == [
        (m, i) for i in range(2) for m in result["methods"]
    ]
    rows = [r for r in result["summary"] if r["task"] == "echo"]
    assert [(r["method"], r["length"], r["n"]) for r in rows] == [
        (m, 64, 2) for m in result["methods"]
    ]
    tables = (tmp_path / "tables.md").read_text()
    assert "## echo: a word asked back\n" in tables and "## sanity: " in tables
    assert "| method | echo 64 | sanity |" in report.overview_table(result["summary"])
    # resumed, nothing is run again
    monkeypatch.setattr(EvalRunner, "run_unit", lambda *a: pytest.fail("recomputed a run"))
    again = EvalRunner(word_model, config, tmp_path).run(resume=True, progress=False, plots=False)
    assert again["records"] == result["records"]


def test_a_new_task_is_refused_once_unregistered(word_model, tmp_path):
    with pytest.raises(UserError, match="unknown task 'echo'"):
        parse_tasks("echo")
