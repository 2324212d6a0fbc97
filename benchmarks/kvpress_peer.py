"""NVIDIA's kvpress as a RULER peer: its presses answer our saved RULER samples.

kvpress (PyPI `kvpress`, `make kvpress-venv`) pins transformers<5.3, so it runs in its own
environment, and this script has two halves:

  the driver (speedkv's .venv):
    .venv/bin/python benchmarks/kvpress_peer.py --kvpress-python .venv-kvpress/bin/python \\
        --tasks ruler --length 4096 --samples 20 --presses snapkv,knorm --ratios 0.267 \\
        --settings agnostic,aware --threads 2 --out runs/ruler-kvpress-4k [--resume]
  loads the RULER samples `speedkv eval --tasks ruler --lengths 4096 --samples ruler=20` uses
  (the same files: seed 0, the model's tokenizer, the count), splits each into context,
  question and answer prefix (`ruler.split_question`), writes the jobs, runs the kvpress half,
  scores every answer with RULER's own metric and writes `records.jsonl` in the shape of
  `speedkv eval`'s RULER records, method names such as
  `kvpress:snapkv,ratio=0.267,setting=agnostic`, after a header line naming kvpress,
  transformers, torch, the model, dtype and settings. --first K runs only the first K samples
  of those files (their indices are speedkv eval's); --check-tokens only checks tokenization.

  the kvpress half (imports only torch, transformers, kvpress and the standard library):
    .venv-kvpress/bin/python benchmarks/kvpress_peer.py --run JOBS --results RESULTS
  loads the HF folder speedkv converts the embedded GGUF to, in bfloat16 with sdpa attention,
  once, and runs kvpress's own `KVPressTextGenerationPipeline` (pipeline("kv-press-text-
  generation")) on every job: greedy, max_new_tokens = RULER's tokens_to_generate for the task,
  for each press and compression ratio and for press=None, kvpress's own full attention.

Presses (--presses), each at kvpress's defaults but the ratio: snapkv (SnapKVPress: window 64,
kernel 5), expected_attention, streaming_llm (4 sink tokens), tova, knorm, kvzip. All six run
offline on a CPU; KVzip replays the context to score it ("Repeat the previous context"), about
five times the prefill's time here.

Settings, as kvpress's own evaluation runs them:
  agnostic: the context is prefilled and compressed without the question (kvpress's default);
    the question, the chat template's end and the answer prefix follow it uncompressed.
  aware: the question is appended to the context (question=""), so the press sees it: what
    kvpress's evaluation does with query_aware.

Per answer: the text, the wall time from the pipeline call to the first token's logits (its
tokenization, the context's prefill and compression, then the question's forward: a TTFT), the
prefill alone, the whole call, output tokens, and the KV bytes held (keys and values of every
layer's cache) after the compressed context and at the first token. KV and TTFT ratios are
taken against press=None on the same prompt and setting. KVzipPress only masks the entries it
drops (its own "fake compression": the cache keeps them), so its bytes held stay those of full
attention; the bytes it leaves unmasked are recorded beside them (`kv_bytes_effective`).

Token check: the pipeline tokenizes the context and the question apart; their ids joined must
equal our prompt's ids (speedkv's RulerSample.prompt.ids, the ids every speedkv method gets).
Every record says whether they do (`ids_match`), and the driver reports each mismatch. On
SmolLM2's tokenizer all 13 tasks' 20 samples at 4096 match in both settings (--check-tokens).

Results are appended as they come (the kvpress half's results.jsonl), so a run stopped
halfway goes on with --resume; records.jsonl is rewritten from them at the end of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = str(Path(__file__).resolve())  # both halves run this file

# press name -> kvpress class; every one takes a compression_ratio (the share of entries removed)
PRESSES = {
    "snapkv": "SnapKVPress",
    "expected_attention": "ExpectedAttentionPress",
    "streaming_llm": "StreamingLLMPress",
    "tova": "TOVAPress",
    "knorm": "KnormPress",
    "kvzip": "KVzipPress",
}
NONE = "none"  # press=None: kvpress's pipeline without compression, the ceiling
SETTINGS = ("agnostic", "aware")
DEFAULT_RATIO = 0.267  # KV ratio 0.733 after compression: what SPEED-22 reaches on SmolLM2
DTYPE = "bfloat16"
ATTENTION = "sdpa"


def method_name(press: str, ratio: float | None, setting: str) -> str:
    """`kvpress:snapkv,ratio=0.267,setting=agnostic`; `kvpress:none,setting=aware`."""
    if press == NONE:
        return f"kvpress:{NONE},setting={setting}"
    return f"kvpress:{press},ratio={ratio:g},setting={setting}"


def log(message: str) -> None:
    print(f"[kvpress_peer] {message}", file=sys.stderr, flush=True)


# == the kvpress half ==========================================================================
def versions() -> dict:
    """What the kvpress environment runs (imports nothing of speedkv)."""
    from importlib import metadata

    return {name: metadata.version(name) for name in ("kvpress", "transformers", "torch")}


def cache_bytes(cache) -> int:
    """Keys and values held in every layer of a transformers cache."""
    total = 0
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            if tensor is not None:
                total += tensor.numel() * tensor.element_size()
    return total


def masked_entries(model) -> int:
    """Entries kvpress masks instead of removing (KVzip, AdaKV-style heads): summed over
    layers, from the indices its attention patch reads at decode time."""
    count = 0
    for layer in model.model.layers:
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:
            count += int(masked[0].numel())
    return count


class Probe:
    """Timings, cache sizes and token ids of one pipeline call, read through hooks on the
    model (the pipeline itself runs unchanged): its first causal-LM forward is the question's,
    whose logits give the first token; every later forward gives one more token."""

    def __init__(self, pipe):
        self.pipe, self.model = pipe, pipe.model
        self.model.register_forward_pre_hook(self._before_lm, with_kwargs=True)
        self.model.register_forward_hook(self._after_lm, with_kwargs=True)
        self.model.model.register_forward_pre_hook(self._before_backbone)
        self.model.model.register_forward_hook(self._after_backbone)
        preprocess = pipe.preprocess

        def recorded(*args, **kwargs):
            out = preprocess(*args, **kwargs)
            self.context_ids = out["context_ids"][0].tolist()
            self.question_ids = [q[0].tolist() for q in out["questions_ids"]]
            return out

        pipe.preprocess = recorded  # the pipeline looks it up on the instance
        self.reset()

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.prefill_start = self.prefill_end = self.first = None
        self.lm_calls = 0
        self.backbone_calls = 0
        self.kv_context = self.kv_first = self.masked = 0
        self.layer_lengths: list[int] = []
        self.context_ids: list[int] = []
        self.question_ids: list[list[int]] = []

    def _before_backbone(self, module, args) -> None:
        self.backbone_calls += 1
        if self.backbone_calls == 1:
            self.prefill_start = time.perf_counter()

    def _after_backbone(self, module, args, output) -> None:
        if self.backbone_calls == 1:
            self.prefill_end = time.perf_counter()

    def _before_lm(self, module, args, kwargs) -> None:
        self.lm_calls += 1
        if self.lm_calls == 1:  # the compressed context, before the question joins it
            cache = kwargs["past_key_values"]
            self.kv_context = cache_bytes(cache)
            self.masked = masked_entries(self.model)

    def _after_lm(self, module, args, kwargs, output) -> None:
        if self.lm_calls == 1:
            self.first = time.perf_counter()
            cache = kwargs["past_key_values"]
            self.kv_first = cache_bytes(cache)
            self.layer_lengths = [layer.keys.shape[-2] for layer in cache.layers]


def make_press(name: str, ratio: float):
    import kvpress

    return getattr(kvpress, PRESSES[name])(compression_ratio=ratio)


def load_pipeline(model_dir: str):
    import kvpress  # noqa: F401  (registers the kv-press-text-generation pipeline)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per answer on stderr, not a bar per load

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation=ATTENTION
    )
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def kept_rows(full, kept) -> list[list[int]]:
    """Per KV head, the positions in `full` ([1, heads, n, dim]) of the rows a press kept
    (`kept`, [1, heads, m, dim]): found by their bits, as the press gathered them."""
    import torch

    out = []
    weights = torch.randint(
        1, 2**31 - 1, (full.shape[-1],), generator=torch.Generator().manual_seed(0)
    )
    for head in range(full.shape[1]):
        bits = [t[0, head].view(torch.int16).long() for t in (full, kept)]
        where = {h: i for i, h in enumerate((bits[0] * weights).sum(-1).tolist())}
        rows = [where[h] for h in (bits[1] * weights).sum(-1).tolist()]
        if not torch.equal(full[0, head, rows], kept[0, head]):
            raise RuntimeError("a kept row was matched to another one")
        out.append(sorted(rows))
    return out


def capture_kept(press, record: dict) -> None:
    """Record, per layer, the positions a ScorerPress keeps in each KV head, and those it
    would keep with its own `score` run in float32 (a float32 copy of the layer, its inputs
    upcast): `record["kept"]`, `record["kept_float32"]`, layer by layer."""
    import copy

    from kvpress.utils import compute_n_kept

    compress = press.compress
    record.update(kept={}, kept_float32={})

    def recorded(module, hidden_states, keys, values, attentions, kwargs):
        out_keys, out_values = compress(module, hidden_states, keys, values, attentions, kwargs)
        layer = int(module.layer_idx)
        record["kept"][layer] = kept_rows(keys, out_keys)
        wide = copy.deepcopy(module).float()
        cos, sin = kwargs["position_embeddings"]
        wide_kwargs = {**kwargs, "position_embeddings": (cos.float(), sin.float())}
        scores = press.score(
            wide, hidden_states.float(), keys.float(), values.float(), None, wide_kwargs
        )
        n_kept = compute_n_kept(keys.shape[2], press.compression_ratio)
        top = scores.topk(n_kept, dim=-1).indices[0]
        record["kept_float32"][layer] = [sorted(row) for row in top.tolist()]
        return out_keys, out_values

    press.compress = recorded  # a dataclass instance: this call's press only


def answer(
    pipe,
    probe: Probe,
    job: dict,
    press_name: str,
    ratio: float | None,
    setting: str,
    kept: dict | None = None,
):
    """One pipeline call: the job's sample under one press, ratio and setting. With `kept`
    (a dict), a scorer press's kept positions are recorded in it (see capture_kept)."""
    press = None if press_name == NONE else make_press(press_name, ratio)
    if kept is not None and press is not None:
        capture_kept(press, kept)
    context, question = pipeline_inputs(job, setting)
    probe.reset()
    out = probe.pipe(
        context,
        question=question,
        answer_prefix=job["answer_prefix"],
        press=press,
        max_new_tokens=job["max_new_tokens"],
    )
    end = time.perf_counter()
    ids = probe.context_ids + probe.question_ids[0]
    at = first_difference(ids, job["ids"])
    tokens = probe.lm_calls  # one token per causal-LM forward, the EOS that stops it included
    row_bytes = 2 * probe.model.config.head_dim * 2  # a masked entry's key and value, bfloat16
    return {
        "press": press_name,
        "ratio": ratio,
        "setting": setting,
        "press_repr": repr(press),
        "answer": out["answer"],
        "output_tokens": tokens,
        "finish_reason": "length" if tokens >= job["max_new_tokens"] else "stop",
        "ttft_s": probe.first - probe.t0,
        "prefill_s": probe.prefill_end - probe.prefill_start,
        "seconds": end - probe.t0,
        "kv_bytes": probe.kv_first,
        "kv_bytes_context": probe.kv_context,
        "kv_bytes_effective": probe.kv_first - probe.masked * row_bytes,
        "layer_lengths": probe.layer_lengths,
        "context_tokens": len(probe.context_ids),
        "question_tokens": len(probe.question_ids[0]),
        "ids_match": at is None,
        **({} if at is None else {"first_mismatch": at, "kvpress_tokens": len(ids)}),
    }


def pipeline_inputs(job: dict, setting: str) -> tuple[str, str]:
    """(context, question) as the pipeline is given them in `setting`."""
    if setting == "aware":  # the press sees the question: kvpress's query_aware
        return job["context"] + job["question"], ""
    return job["context"], job["question"]


def check_tokens(args) -> None:
    """The pipeline's own tokenization of every job in both settings against the prompt's ids,
    without running the model: a JSON report on stdout."""
    spec = json.loads(Path(args.tokens_of).read_text())
    pipe = load_pipeline(spec["model"])
    limit = pipe.tokenizer.model_max_length
    checked, mismatches = 0, []
    for job in spec["jobs"]:
        for setting in SETTINGS:
            context, question = pipeline_inputs(job, setting)
            ids = pipe.preprocess(context, [question], job["answer_prefix"], limit)
            got = ids["context_ids"][0].tolist() + ids["questions_ids"][0][0].tolist()
            at = first_difference(got, job["ids"])
            checked += 1
            if at is not None:
                mismatches.append({"job": job["key"], "setting": setting, "first_mismatch": at})
    print(json.dumps({"checked": checked, "mismatches": mismatches}))


def run_jobs(args) -> None:
    import torch

    spec = json.loads(Path(args.run).read_text())
    torch.set_num_threads(spec["threads"])
    results = Path(args.results)
    done = set()
    if results.exists():
        for line in results.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill: its run is done again
            if "job" in row:
                done.add((row["job"], row["method"]))
    presses = spec["presses"]
    plan = []
    for job in spec["jobs"]:
        for setting in spec["settings"]:
            runs = [(NONE, None)] + [(p, r) for p in presses for r in spec["ratios"]]
            for press, ratio in runs:
                method = method_name(press, ratio, setting)
                if (job["key"], method) not in done:
                    plan.append((job, press, ratio, setting, method))
    log(f"{len(plan)} runs to do ({len(done)} already recorded), {spec['threads']} threads")
    if not plan:
        return
    t_load = time.perf_counter()
    pipe = load_pipeline(spec["model"])
    probe = Probe(pipe)
    # the first call pays for one-off set-up (thread pools, kernels): a short one before timing
    warm = dict(plan[0][0], context=plan[0][0]["context"][:2000], max_new_tokens=2)
    answer(pipe, probe, warm, NONE, None, "agnostic")
    log(f"model loaded and warmed up in {time.perf_counter() - t_load:.1f} s")
    started = time.perf_counter()
    with results.open("a") as sink:
        for k, (job, press, ratio, setting, method) in enumerate(plan):
            kept = {} if args.kept and press == "snapkv" else None
            row = answer(pipe, probe, job, press, ratio, setting, kept)
            row = {"job": job["key"], "method": method, "threads": spec["threads"], **row}
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            if kept:
                with open(args.kept, "a") as out:
                    out.write(json.dumps({"job": job["key"], "method": method, **kept}) + "\n")
            elapsed = time.perf_counter() - started
            eta = elapsed / (k + 1) * (len(plan) - k - 1)
            flag = "" if row["ids_match"] else f", ids differ at {row['first_mismatch']}"
            log(
                f"{k + 1}/{len(plan)} {job['key']} {method}: {row['seconds']:.1f} s, TTFT "
                f"{row['ttft_s']:.2f} s, {row['output_tokens']} tokens, KV "
                f"{row['kv_bytes'] / 2**20:.1f} MiB{flag}; {row['answer'][:40]!r}; "
                f"ETA {eta / 60:.1f} min"
            )


# == the driver ================================================================================
def kvpress_versions(python: str) -> dict:
    """The kvpress environment's versions, or a clear error when it is missing or broken."""
    if not Path(python).exists():
        sys.exit(f"no kvpress environment at {python}: build it with `make kvpress-venv`")
    done = subprocess.run(
        [python, SCRIPT, "--versions"], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit code {done.returncode}"
        sys.exit(f"{python} cannot run kvpress ({reason}): rebuild it with `make kvpress-venv`")
    return json.loads(done.stdout)


def parse_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def prepare_samples(args, tokenizer) -> list[tuple[str, int, object]]:
    """(task, index, RulerSample) of every job, sample-major as `speedkv eval` runs them: the
    files `speedkv eval --tasks ruler --lengths L --samples ruler=N` reads."""
    from speedkv.errors import UserError
    from speedkv.evals import ruler

    tasks = ruler.expand(parse_list(args.tasks))
    unknown = [t for t in tasks if not ruler.is_ruler(t) or t not in ruler.TASKS]
    if unknown:
        sys.exit(f"unknown RULER task {unknown[0]!r}; tasks: ruler, {', '.join(ruler.TASKS)}")
    for task in tasks:
        if args.length < ruler.min_length(task):
            sys.exit(
                f"--length {args.length} is too short for {task}: it needs at least "
                f"{ruler.min_length(task)} ({ruler.why_min_length(task)})"
            )
    root = ruler.data_root(args.ruler_data)
    try:
        wanted = [(t, args.length, args.samples) for t in tasks]
        ruler.ensure_samples(tokenizer, wanted, args.seed, root, log)
        loaded = {
            t: ruler.load_samples(tokenizer, t, args.length, args.seed, args.samples, root)
            for t in tasks
        }
    except UserError as e:
        sys.exit(str(e))
    first = args.samples if args.first is None else min(args.first, args.samples)
    return [(t, i, loaded[t][i]) for i in range(first) for t in tasks]


def job_key(task: str, length: int, index: int) -> str:
    return f"{task}@{length}#{index}"


def make_jobs(samples: list, length: int) -> list[dict]:
    from speedkv.evals import ruler

    jobs = []
    for task, index, sample in samples:
        spec = ruler.task_spec(task)
        context, question, _ = ruler.split_question(sample.input, spec)
        jobs.append(
            {
                "key": job_key(task, length, index),
                "context": context,
                "question": question,
                # the prompt's reply starts with it (RULER's answer prefix, its space dropped)
                "answer_prefix": sample.reply_start,
                "ids": sample.prompt.ids,
                "max_new_tokens": spec.tokens_to_generate,
            }
        )
    return jobs


def read_results(path: Path) -> list[dict]:
    """The kvpress half's results, the last copy of each (job, method)."""
    rows: dict[tuple[str, str], dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "job" in row:
                rows[(row["job"], row["method"])] = row
    return list(rows.values())


def build_records(samples: list, length: int, rows: list[dict]) -> tuple[list[dict], list[str]]:
    """`speedkv eval`-shaped records of every result with its press=None reference, scored
    with RULER's metric; and a line for each token mismatch."""
    from speedkv.evals import ruler

    by_job = {}
    for row in rows:
        by_job.setdefault(row["job"], {})[row["method"]] = row
    records, mismatches = [], []
    for task, index, sample in samples:
        got = by_job.get(job_key(task, length, index), {})
        for method, row in got.items():
            full = got.get(method_name(NONE, None, row["setting"]))
            if full is None:
                continue  # its reference did not finish: written when it has
            records.append(
                {
                    "method": method,
                    "task": task,
                    "length": length,
                    "sample": index,
                    "prompt_tokens": len(sample.prompt.ids),
                    "id": sample.index,
                    "input_sha": sample.input_sha,
                    "ruler_length": sample.length,
                    "reply_start": sample.reply_start,
                    "answer": row["answer"],
                    "references": sample.outputs,
                    "metric": ruler.task_spec(task).metric,
                    "score": ruler.score(task, row["answer"], sample.outputs),
                    "output_tokens": row["output_tokens"],
                    "finish_reason": row["finish_reason"],
                    "kv_bytes": row["kv_bytes"],
                    "kv_ratio": row["kv_bytes"] / full["kv_bytes"],
                    "kv_ratio_effective": row["kv_bytes_effective"] / full["kv_bytes"],
                    "ttft_s": row["ttft_s"],
                    "ttft_ratio": row["ttft_s"] / full["ttft_s"],
                    "seconds": row["seconds"],
                    "prefill_s": row["prefill_s"],
                    "setting": row["setting"],
                    "press": row["press"],
                    "compression_ratio": row["ratio"],
                    "context_tokens": row["context_tokens"],
                    "question_tokens": row["question_tokens"],
                    "kv_bytes_context": row["kv_bytes_context"],
                    "ids_match": row["ids_match"],
                    "threads": row["threads"],
                }
            )
            if not row["ids_match"]:
                mismatches.append(
                    f"{task} #{index} {method}: kvpress's ids ({row['kvpress_tokens']}) differ "
                    f"from the prompt's ({len(sample.prompt.ids)}) at {row['first_mismatch']}"
                )
    order = {m: k for k, m in enumerate(dict.fromkeys(r["method"] for r in records))}
    records.sort(key=lambda r: (r["task"], r["sample"], order[r["method"]]))
    return records, mismatches


def summary(records: list[dict]) -> str:
    """Per method and task: mean score, KV and TTFT ratios, seconds per sample."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["method"], r["task"]), []).append(r)
    lines = [
        "| method | task | n | score | KV ratio | KV effective | TTFT ratio | s/sample |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (method, task), rs in sorted(groups.items()):

        def mean(key: str, rs=rs) -> float:
            return sum(r[key] for r in rs) / len(rs)

        lines.append(
            f"| `{method}` | {task.removeprefix('ruler/')} | {len(rs)} | "
            f"{100 * mean('score'):.1f} | {mean('kv_ratio'):.3f} | "
            f"{mean('kv_ratio_effective'):.3f} | {mean('ttft_ratio'):.2f} | "
            f"{mean('seconds'):.1f} |"
        )
    return "\n".join(lines)


def drive(args) -> None:
    from speedkv.evals import ruler
    from speedkv.hf.loading import load_tokenizer, model_directory

    presses = parse_list(args.presses)
    unknown = [p for p in presses if p not in PRESSES]
    if unknown:
        sys.exit(f"unknown press {unknown[0]!r}; presses: {', '.join(PRESSES)}")
    settings = parse_list(args.settings)
    if not settings or any(s not in SETTINGS for s in settings):
        sys.exit(f"--settings takes {' and/or '.join(SETTINGS)}, got {args.settings!r}")
    ratios = [float(r) for r in parse_list(args.ratios)]
    if any(not 0 < r < 1 for r in ratios):
        sys.exit(f"compression ratios are fractions in (0, 1), got {args.ratios!r}")
    found = kvpress_versions(args.kvpress_python)
    model_dir = str(model_directory(args.model, progress=False))
    tokenizer = load_tokenizer(model_dir)
    samples = prepare_samples(args, tokenizer)
    header = {
        "peer": "kvpress",
        "pipeline": "KVPressTextGenerationPipeline (kv-press-text-generation), greedy",
        **found,
        "model": args.model,
        "hf_model": model_dir,
        "dtype": DTYPE,
        "attn_implementation": ATTENTION,
        "seed": args.seed,
        "ruler": f"{ruler.PACKAGE} {ruler.package_version()}",
        "settings": {
            "agnostic": "context compressed without the question (kvpress's default)",
            "aware": "question appended to the context, question='' (kvpress's query_aware)",
        },
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs_path = out / "jobs.json"
    jobs_path.write_text(
        json.dumps(
            {
                "model": model_dir,
                "threads": args.threads,
                "presses": presses,
                "ratios": ratios,
                "settings": settings,
                "jobs": make_jobs(samples, args.length),
            }
        )
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env |= {"OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    if args.check_tokens:
        command = [args.kvpress_python, SCRIPT, "--tokens-of", str(jobs_path)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        report = json.loads(done.stdout)
        for miss in report["mismatches"]:
            log(f"ids differ: {miss}")
        log(
            f"token check: {report['checked'] - len(report['mismatches'])} of "
            f"{report['checked']} (sample, setting) pairs tokenize to the prompt's ids"
        )
        sys.exit(1 if report["mismatches"] else 0)
    results = out / "kvpress-results.jsonl"
    first = results.read_text().splitlines()[:1] if results.exists() else []
    if args.resume and first and json.loads(first[0]).get("header") != header:
        sys.exit(
            f"{results} was made with other settings ({first[0]}); use another --out, or the "
            "same kvpress, transformers, torch, model and seed"
        )
    if not args.resume or not first:
        results.write_text(json.dumps({"header": header}) + "\n")
    command = [args.kvpress_python, SCRIPT, "--run", str(jobs_path), "--results", str(results)]
    half = subprocess.Popen(command, env=env)
    # a SIGTERM stops the half too, and what it finished is still written out below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        code = half.wait()
    except (KeyboardInterrupt, SystemExit) as stop:
        code = 130 if isinstance(stop, KeyboardInterrupt) else 143
    finally:
        if half.poll() is None:
            half.terminate()
            half.wait()
    records, mismatches = build_records(samples, args.length, read_results(results))
    with (out / "records.jsonl").open("w") as sink:
        sink.write(json.dumps({"header": header}) + "\n")
        for record in records:
            sink.write(json.dumps(record) + "\n")
    print(summary(records))
    checked = len(records)
    log(
        f"token check: {checked - len(mismatches)} of {checked} answers had kvpress's context "
        "and question ids equal to the prompt's ids"
    )
    for line in mismatches:
        log(f"ids differ: {line}")
    log(f"{len(records)} records in {out / 'records.jsonl'}")
    if code != 0:
        sys.exit(f"the kvpress half stopped (exit code {code}); rerun with --resume to go on")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Run by speedkv's Python it drives (loads samples, scores, writes records); "
        "run by the kvpress environment's Python with --run it answers the jobs. See the "
        "module docstring for the settings and what is measured.",
    )
    driver = parser.add_argument_group("driver (speedkv's environment)")
    driver.add_argument(
        "--kvpress-python",
        default=".venv-kvpress/bin/python",
        help="the Python of the kvpress environment (make kvpress-venv)",
    )
    driver.add_argument("--tasks", default="ruler", help="ruler (all 13) or ruler/<task>,...")
    driver.add_argument("--length", type=int, default=4096, help="RULER's sequence length")
    driver.add_argument(
        "--samples",
        type=int,
        default=20,
        help="samples per task (the count is part of the sample files' key, as in speedkv eval)",
    )
    driver.add_argument(
        "--first",
        type=int,
        help="run only the first samples of the --samples files (the same samples and indices "
        "as speedkv eval's first ones)",
    )
    driver.add_argument(
        "--presses",
        default=",".join(PRESSES),
        help=f"comma-separated, of {', '.join(PRESSES)}; press=None always runs as the reference",
    )
    driver.add_argument(
        "--ratios",
        default=str(DEFAULT_RATIO),
        help="kvpress compression ratios, the share of the compressed entries removed "
        f"(default {DEFAULT_RATIO}: 0.733 of them kept, SPEED-22's KV ratio on SmolLM2)",
    )
    driver.add_argument("--settings", default="agnostic,aware", help="agnostic and/or aware")
    driver.add_argument("--threads", type=int, default=2, help="torch threads in kvpress's run")
    driver.add_argument("--model", default="smollm2-135m", help="speedkv model name or path")
    driver.add_argument("--seed", type=int, default=0, help="RULER seed (speedkv eval's --seed)")
    driver.add_argument("--ruler-data", help="where RULER's samples are kept (speedkv eval's)")
    driver.add_argument("--out", default="runs/ruler-kvpress-4k", help="output directory")
    driver.add_argument("--resume", action="store_true", help="keep results already in --out")
    driver.add_argument(
        "--check-tokens",
        action="store_true",
        help="only check that kvpress's pipeline tokenizes every sample, in both settings, to "
        "the prompt's ids (seconds: nothing is generated)",
    )
    half = parser.add_argument_group("kvpress half (the kvpress environment)")
    half.add_argument("--run", help="a jobs file the driver wrote: answer its jobs")
    half.add_argument("--results", help="with --run: the results file to append to")
    half.add_argument(
        "--kept",
        help="with --run: append SnapKV's kept positions per layer and KV head (and those of "
        "its scores in float32) to this jsonl (benchmarks/kvpress_snapkv.py reads them)",
    )
    half.add_argument(
        "--tokens-of",
        metavar="JOBS",
        help="a jobs file: report the pipeline's tokenization against each job's ids (JSON)",
    )
    half.add_argument("--versions", action="store_true", help="print kvpress's versions (JSON)")
    args = parser.parse_args()
    if args.versions:
        print(json.dumps(versions()))
    elif args.tokens_of:
        check_tokens(args)
    elif args.run:
        if not args.results:
            parser.error("--run needs --results")
        run_jobs(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
