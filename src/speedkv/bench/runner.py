"""`speedkv bench`: TTFT, TPOT, KV memory, peak RSS and FLOPs of methods across prompt lengths.

Every cell (method x length) is measured `repeats` times, after one warm-up run of each method
at the shortest length; within each repeat
all methods run back to back on the same prompt (each repeat in a rotated order), so machine
noise hits them alike, and every ratio is taken against `full` from the same repeat. Raw runs
go to `runs.jsonl` as they finish, so an interrupted sweep resumes where it stopped
(`--resume`).

The run also measures this machine's read bandwidth and matmul rate (`roofline`) and reports
each cell against its limit: TPOT against the bytes a step must read (weights + visible K/V),
TTFT against the prefill FLOPs at the matmul rate.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from speedkv.bench.machine import machine_facts
from speedkv.bench.memory import peak_rss_bytes, reset_peak_rss
from speedkv.bench.report import HF, write_outputs
from speedkv.bench.roofline import MachineLimits, measure_limits
from speedkv.core.engine import Engine, Request
from speedkv.core.registry import MethodSpec, config_record, make_policy
from speedkv.core.sampling import SamplingParams
from speedkv.errors import UserError
from speedkv.hf.loading import LoadedModel, dtype_name, resolve_dtype, wrap_model
from speedkv.log import log
from speedkv.prompts.builders import exact_chat_prompt

METRICS = (
    "ttft_s",
    "tpot_s",
    "kv_bytes",
    "kv_bytes_final",
    "peak_rss_bytes",
    "flops_prefill",
    "flops_decode",
)
RATIOS = {
    "ttft_s": "ttft_ratio",
    "tpot_s": "tpot_ratio",
    "kv_bytes": "kv_ratio",
    "kv_bytes_final": "kv_final_ratio",
    "peak_rss_bytes": "rss_ratio",
    "flops_prefill": "flops_prefill_ratio",
    "flops_decode": "flops_decode_ratio",
}


@dataclass
class BenchConfig:
    model: str
    methods: list[MethodSpec | str]  # parsed specs, or their text; 'hf' is the model's generate
    lengths: list[int]
    new_tokens: int = 128
    repeats: int = 5
    dtype: str = "auto"
    warmup_tokens: int = 4
    command: str = ""  # the command line that produced the results, for the report


def check_config(config: BenchConfig, max_positions: int) -> None:
    """A sweep's settings that cannot run, as one sentence, before anything is measured."""
    too_long = [n for n in config.lengths if n > max_positions]
    if too_long:
        raise UserError(
            f"length {too_long[0]} is longer than the model's context of {max_positions} tokens"
        )
    if config.repeats < 1:
        raise UserError(f"repeats must be at least 1, got {config.repeats}")
    if config.new_tokens < 2:
        raise UserError(
            f"max-new-tokens must be at least 2 (TPOT needs two), got {config.new_tokens}"
        )


def rotated(methods: list[str], repeat: int) -> list[str]:
    """The methods in the order repeat `repeat` runs them: each repeat starts one further on,
    so whatever the first run after a length switch pays is not always paid by the same one."""
    shift = repeat % len(methods)
    return methods[shift:] + methods[:shift]


class Bench:
    def __init__(self, model: LoadedModel, config: BenchConfig, out: Path):
        self.model, self.config, self.out = model, config, out
        self.engine = Engine(model)
        self._limits: MachineLimits | None = None
        self.decode_mode = "prepacked" if model.backbone.prepacked else "plain"
        # full first: every ratio is taken against it; a method given twice runs once
        bound = [
            m if m == HF else make_policy(m, model.shape, model.trained_method)
            for m in ["full", *config.methods]
        ]
        self.policies = {p.spec(): p for p in bound if p != HF}
        self.methods = list(dict.fromkeys(HF if p == HF else p.spec() for p in bound))
        check_config(config, model.shape.max_positions)
        if self.engine.records_graphs and self.engine.recorded_decode != "never":
            self.notes += (
                "Decode steps replayed a recorded CUDA graph, one launch a token, its recording "
                "counted in TPOT (`SPEEDKV_RECORDED_DECODE=never` launches every kernel from the "
                "host; docs/gpu.md).",
            )
        self.hf_model = self._hf_peer() if HF in self.methods else model

    def _hf_peer(self) -> LoadedModel:
        """The model `hf` runs: transformers as a user of this machine would load it. Where
        `auto` chose bfloat16 for speedkv's kernels but the CPU has no bf16 products,
        transformers' own layers would run bfloat16 as a plain loop (a 1K prefill of SmolLM2 on
        an AVX2 Zen 3: 28.4 s against float32's 5.5 s), so `hf` gets a float32 copy of the
        weights (twice the model's memory more)."""
        model = self.model
        wanted = resolve_dtype("auto", self.engine.device, native_decode=False)
        if self.config.dtype != "auto" or wanted == model.dtype or model.backbone.int8_weights:
            return model
        self.notes += (
            f"`hf` ran a {dtype_name(wanted)} copy of the weights: this CPU has no bf16 "
            "products, and transformers' own layers would run bfloat16 as a plain loop.",
        )
        return wrap_model(
            copy.deepcopy(model.hf_model).to(wanted), model.tokenizer, model.name, model.source
        )

    # -- one measurement -------------------------------------------------------------------
    def measure(self, method: str, ids: list[int], new_tokens: int) -> dict:
        reset_peak_rss()
        if method == HF:
            r = self.hf_model.backbone.hf_generate_timed(
                torch.tensor([ids], device=self.engine.device), new_tokens
            )
            per = self.model.shape.kv_bytes_per_token_layer(self.hf_model.dtype)
            row = {
                "ttft_s": r["ttft_s"],
                "tpot_s": r["tpot_s"],
                "kv_bytes": len(ids) * self.model.shape.num_layers * per,
                "kv_bytes_final": r["kv_bytes_final"],
                "flops_prefill": None,
                "flops_decode": None,
                "output_ids": r["output_ids"],
            }
        else:
            sampling = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
            g = self.engine.generate([Request(ids, self.policies[method], sampling)])[0]
            row = {
                k: getattr(g, k)
                for k in (
                    "ttft_s",
                    "tpot_s",
                    "kv_bytes",
                    "kv_bytes_final",
                    "flops_prefill",
                    "flops_decode",
                    "output_ids",
                )
            }
        row["peak_rss_bytes"] = peak_rss_bytes()
        return row

    # -- the sweep ----------------------------------------------------------------------------
    def run(self, resume: bool, progress: bool = True) -> dict:
        cfg = self.config
        self.out.mkdir(parents=True, exist_ok=True)
        runs_path = self.out / "runs.jsonl"
        header = {
            "model": cfg.model,
            "dtype": self.dtype_name,
            "new_tokens": cfg.new_tokens,
            "decode": self.decode_mode,
        }
        settings = "model, dtype, max-new-tokens and --prepack/--no-prepack"
        runs = start_runs(runs_path, header, settings, resume, self.methods, cfg.lengths)
        if progress:
            # stderr, like every progress line: stdout carries the table or --json
            log(f"machine limits: {self.limits().describe()}", source="bench")
        todo = pending_runs(runs, cfg.repeats, cfg.lengths, self.methods)
        # one warm-up per method, at its shortest pending length: first-call costs do not
        # grow with the prompt, and a warm-up at 32K tokens would cost minutes
        shortest = {m: min(n for _, n, pending in todo if pending == m) for _, _, m in todo}
        warm = sorted((n, m) for m, n in shortest.items())
        bar = tqdm(
            total=len(warm) + len(todo),
            disable=not progress,
            unit="run",
            desc="bench",
            dynamic_ncols=True,
        )
        for n, m in warm:
            bar.set_postfix_str(f"warm-up {m} @ {n}")
            self.measure(m, self.prompt(n, repeat=-1), cfg.warmup_tokens)
            bar.update()
        append_runs(
            runs_path,
            todo,
            lambda m, n, rep: self.measure(m, self.prompt(n, rep), cfg.new_tokens),
            runs,
            bar,
            cfg.repeats,
        )
        bar.close()
        return self.summarise(runs)

    # -- what the sweep needs of the engine (VllmBench answers them for vLLM) ----------------
    prompt_per_repeat = False  # every repeat measures the same prompt of each length
    notes: tuple[str, ...] = ()  # how this engine was measured, beyond the config (reports)

    def prompt(self, length: int, repeat: int) -> list[int]:
        """The prompt of `length` tokens a repeat measures (repeat -1: the warm-up)."""
        start = 7 * (repeat + 1) if self.prompt_per_repeat else 0
        cache = self.__dict__.setdefault("_prompts", {})
        if (length, start) not in cache:
            cache[length, start] = exact_chat_prompt(self.tokenizer, length, start)
        return cache[length, start]

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def dtype_name(self) -> str:
        return self.model.dtype_name

    def decode_weight_bytes(self) -> int:
        return self.model.backbone.decode_weight_bytes()

    def limits(self) -> MachineLimits:
        """Measured once per run, after the model is loaded, before the sweep."""
        if self._limits is None:
            self._limits = measure_limits(
                self.engine.device,
                self.model.dtype,
                self.model.backbone.int8_weights,
                self.model.backbone.prepacked,
            )
        return self._limits

    # -- results ----------------------------------------------------------------------------
    def summarise(self, runs: list[dict]) -> dict:
        by_key: dict[tuple[int, int, str], dict] = {
            (r["repeat"], r["length"], r["method"]): r for r in runs
        }
        cells = []
        for n in self.config.lengths:
            for m in self.methods:
                mine = [
                    r
                    for (rep, length, meth), r in sorted(by_key.items())
                    if length == n and meth == m
                ]
                if not mine:
                    continue
                cell = {"method": m, "length": n, "repeats": len(mine)}
                for metric in METRICS:
                    values = [r[metric] for r in mine if r[metric] is not None]
                    cell[metric] = statistics.median(values) if values else None
                    cell[metric + "_min"] = min(values) if values else None
                    cell[metric + "_max"] = max(values) if values else None
                    ratios = [
                        r[metric] / by_key[(r["repeat"], n, "full")][metric]
                        for r in mine
                        if r[metric] is not None
                        and (r["repeat"], n, "full") in by_key
                        and by_key[(r["repeat"], n, "full")][metric]
                    ]
                    cell[RATIOS[metric]] = statistics.median(ratios) if ratios else None
                cell["same_tokens_as_full"] = all(
                    r["output_ids"] == by_key[(r["repeat"], n, "full")]["output_ids"]
                    for r in mine
                    if (r["repeat"], n, "full") in by_key
                )
                cells.append(cell)
        limits = self.limits()
        weight_bytes = self.decode_weight_bytes()
        add_bounds(cells, limits, weight_bytes)
        result = {
            "config": config_record(self.config),
            "methods": self.methods,
            "dtype": self.dtype_name,
            "decode": self.decode_mode,
            "machine": machine_facts(),
            "notes": list(self.notes),
            "limits": {
                "bandwidth_gb_s": limits.bandwidth_bytes_s / 1e9,
                "matmul_tflop_s": limits.matmul_flops_s / 1e12,
                "gemv_gb_s": (limits.gemv_bytes_s or 0) / 1e9,
                "dtype": limits.dtype,
                "decode_weight_bytes": weight_bytes,
            },
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "cells": cells,
        }
        write_outputs(result, self.out)
        return result


# -- the raw runs of a sweep, shared with bench-reuse --------------------------------------------
def start_runs(
    path: Path, header: dict, settings: str, resume: bool, methods: list[str], lengths: list[int]
) -> list[dict]:
    """The runs of these methods and lengths a sweep already wrote to `path` when resuming
    (made with `header`'s settings, which `settings` names for the error); otherwise none,
    and `path` starts again with the header."""
    if not resume or not path.exists():
        path.write_text(json.dumps({"header": header}) + "\n")
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines or lines[0].get("header") != header:
        found = lines[0].get("header") if lines else "none"
        raise UserError(
            f"{path} was measured with other settings ({found}); "
            f"use another --out or the same {settings}"
        )
    return [r for r in lines[1:] if r["method"] in methods and r["length"] in lengths]


def pending_runs(
    runs: list[dict], repeats: int, lengths: list[int], methods: list[str]
) -> list[tuple[int, int, str]]:
    """(repeat, length, method) still to measure: repeat by repeat, every length, the methods
    in each repeat's rotated order."""
    done = {(r["repeat"], r["length"], r["method"]) for r in runs}
    return [
        (rep, n, m)
        for rep in range(repeats)
        for n in lengths
        for m in rotated(methods, rep)
        if (rep, n, m) not in done
    ]


def append_runs(
    path: Path,
    todo: list[tuple[int, int, str]],
    measure: Callable[[str, int, int], dict],
    runs: list[dict],
    bar: tqdm,
    repeats: int,
) -> None:
    """Measure each pending run (`measure(method, length, repeat)`) and append it to `path`
    and `runs` as soon as it is done, so a stopped sweep keeps every finished run."""
    with path.open("a") as sink:
        for rep, n, m in todo:
            bar.set_postfix_str(f"repeat {rep + 1}/{repeats} {m} @ {n}")
            row = {"repeat": rep, "length": n, "method": m, **measure(m, n, rep)}
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            runs.append(row)
            bar.update()


def add_bounds(cells: list[dict], limits: MachineLimits, weight_bytes: int) -> None:
    """Each cell's hardware limits and how many times them it took. A decode step reads the
    weights and, on average, the mean of the K/V held at the first and the last token; `hf`
    does the same work as `full`, so it gets full's prefill FLOPs."""
    full_flops = {c["length"]: c["flops_prefill"] for c in cells if c["method"] == "full"}
    for c in cells:
        kv_read = (c["kv_bytes"] + c["kv_bytes_final"]) / 2
        c["tpot_bound_s"] = limits.decode_bound_s(weight_bytes, kv_read)
        # the part of that bound spent reading K/V: what a method that reads less can save
        c["kv_read_share"] = limits.decode_bound_s(0, kv_read) / c["tpot_bound_s"]
        flops = c["flops_prefill"]
        if flops is None:
            flops = full_flops.get(c["length"])
        c["ttft_bound_s"] = limits.prefill_bound_s(flops) if flops else None
        for metric in ("tpot", "ttft"):
            bound, took = c[f"{metric}_bound_s"], c[f"{metric}_s"]
            c[f"{metric}_x_bound"] = took / bound if bound and took is not None else None
