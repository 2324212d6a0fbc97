"""The served RULER board (benchmarks/ruler-served/): RULER's own client and scorer against a
server (speedkv.evals.ruler_served runs them) beside the in-process answers on the same samples,
sample by sample and per task."""

from __future__ import annotations

from speedkv.errors import UserError
from speedkv.evals import ruler
from speedkv.evals.ruler_served import ServedTask


def compare(
    served: dict[str, ServedTask], records: list[dict], method: str, length: int
) -> tuple[list[dict], list[dict]]:
    """Per-sample and per-task rows: the served answers and scores beside the in-process
    records of `method` (its canonical spec) on the same samples."""
    samples, tasks = [], []
    for task, result in served.items():
        mine = {
            int(r["id"]): r
            for r in records
            if r["method"] == method and r["task"] == task and r["length"] == length
        }
        missing = [i for i in result.indices if i not in mine]
        if missing:
            raise UserError(
                f"no in-process record of {method} on {task} sample {missing[0]} at {length}; "
                "run speedkv eval on the same tasks, length, samples and seed"
            )
        rows = []
        for i, index in enumerate(result.indices):
            record = mine[index]
            own = result.prompt_tokens  # the chat route's prompt is not the in-process one
            tokens = own[i] if own is not None else record["prompt_tokens"]
            if record["input_sha"] != result.input_shas[i] or record["prompt_tokens"] != tokens:
                raise UserError(
                    f"{task} sample {index}: the in-process record was made on another prompt "
                    f"(input {record['input_sha']}, {record['prompt_tokens']} tokens; served "
                    f"{result.input_shas[i]}, {tokens} tokens)"
                )
            prediction, score = result.predictions[i], result.per_sample[i]
            rows.append(
                {
                    "method": method,
                    "route": result.route,
                    "task": task,
                    "index": index,
                    "input_sha": record["input_sha"],
                    "prompt_tokens": record["prompt_tokens"],
                    "served_answer": prediction,
                    "inprocess_answer": record["answer"],
                    "identical": prediction == record["answer"],
                    "served_score": score,
                    "inprocess_score": record["score"],
                    # the package's metric on the in-process answer: the scorers agree too
                    "rescored": ruler.score(task, record["answer"], record["references"]),
                }
            )
        inprocess = 100 * sum(r["inprocess_score"] for r in rows) / len(rows)
        tasks.append(
            {
                "method": method,
                "route": result.route,
                "task": task,
                "n": len(rows),
                "served_score": result.score,
                "inprocess_score": round(inprocess, 2),  # as the scorer rounds
                "identical": sum(r["identical"] for r in rows),
                "scores_equal": all(r["served_score"] == r["inprocess_score"] for r in rows),
            }
        )
        samples += rows
    return samples, tasks


def markdown_table(tasks: list[dict]) -> str:
    """Per method, route and task: the served score, the in-process one, identical answers."""
    lines = [
        "| method | route | task | served score | in-process score | identical answers |",
        "|---|---|---|---:|---:|---|",
    ]
    for row in tasks:
        same = "yes" if row["identical"] == row["n"] else "no"
        lines.append(
            f"| `{row['method']}` | {row['route']} | {ruler.ruler_name(row['task'])} | "
            f"{row['served_score']:.1f} | {row['inprocess_score']:.1f} | "
            f"{same} ({row['identical']}/{row['n']}) |"
        )
    return "\n".join(lines) + "\n"


def served_page(result: dict) -> str:
    """The served board (table.md) from its results.json: what was run, the verdict on the
    completion route, and the per-task table."""
    completion = [r for r in result["tasks_table"] if r["route"] == "completion"]
    equal = all(r["identical"] == r["n"] and r["scores_equal"] for r in completion)
    verdict = (
        "every answer of the completion route is identical to the in-process one, so every "
        "score is equal"
        if equal
        else "the completion route's answers are NOT all identical to the in-process ones"
    )
    routes = (
        "Routes: **completion** posts each sample's input to /v1/completions, laid out in the "
        "model's chat template exactly as the in-process prompt (checked token for token), the "
        "answer prefix opening the reply"
    )
    if "chat" in result["routes"]:
        routes += (
            "; **chat** sends RULER's input unchanged as one user message to "
            "/v1/chat/completions (the package's OpenAI client), so the answer prefix ends the "
            "question instead of opening the reply and answers may differ by design"
        )
    versions = result["versions"]
    return (
        f"# RULER through its own client against `speedkv serve`\n\n"
        f"{result['package']}; model `{result['model']}` ({result['dtype']}), RULER length "
        f"{result['length']}, {result['samples']} samples per task, seed {result['seed']}; "
        f"{result['server']}. Scores in percent: the served ones from RULER's scorer "
        f"(`{result['scorer']}`), the in-process ones the mean of `speedkv eval`'s records. "
        f"Measured {result['date']} with speedkv {versions.get('speedkv')} in "
        f"{result['elapsed_s'] / 60:.0f} min. Regenerate with `{result['command']}`.\n\n"
        f"{routes}.\n\nResult: {verdict}.\n\n" + markdown_table(result["tasks_table"])
    )
