#!/usr/bin/env python3
"""The GPU check, as one command: the engine's reference tests on the device, then `full`
against SPEED-24 (BoS anchor) at the paper's scale, Llama-3.1-8B's shape with random bfloat16
weights, beside transformers' own `generate` (SDPA), and where a step's time goes.

    PYTHONPATH=src python3 benchmarks/gpu.py --out OUT                       # on a GPU
    PYTHONPATH=src python3 benchmarks/gpu.py --tiny --device cpu --out OUT   # tiny, anywhere

It runs from the source tree, in the repository's root (speedkv is not installed there:
PYTHONPATH=src, as `make gpu-check` sets it; the engine's tests pass on transformers 5.17, the
newest a lent GPU machine has) and writes, under OUT:

- `exactness.json`: the outcome of every reference test run with `--device` (the float32
  tests of tests/unit/test_engine_equivalence.py, test_batch.py, test_prefix_reuse.py,
  test_methods_equivalence.py and test_graph_decode.py on tiny random Llama and Qwen2
  models); off the CPU, again with every decode step recorded (`exactness_recorded`),
- `efficiency.json`: TTFT, TPOT (64 new tokens) and KV bytes per method and prompt length,
  batch 1, with same-run ratios against `full` and SPEED's layer limits; each method once
  through the engine as a user runs it (on a GPU its decode steps replay a recorded CUDA
  graph that attends by flash attention, core/graph_decode.py), and once per variant
  (`--variants`), against `full` run the same way: `+eager` launches every step's kernels
  from the host, `+matmul` records steps that attend by masked matrix products, and
  `+chunk1024` prefills in chunks of 1024 rows (the engine's 8192 on a GPU); a length or
  method that runs out of memory, fails or comes past the time budget is recorded as such,
- `batch.json`: decode tokens a second of `full` and SPEED with 8 and 32 sequences of 16K and
  32K tokens decoding together, each with its own prompt, with same-run ratios; a cell whose
  caches would not fit in the device's memory is recorded as such,
- `attention.json`: one decode query's attention over one layer's cache at the shortest and
  longest length, by the engine's kernel, by torch's fused attention with each backend, and
  by two kernels a recorded step could use (the length on the device),
- `profile.json`: torch's profiler over one prefill and one decode step per method: the
  operators that took the most device time, and how often the host waited for the device;
  and a decode step's time to issue against its time to finish.

Time does not depend on the weights' values, so random weights measure what a trained model
would cost. `pytest` must be importable; `--wheels DIR` installs it from wheel files there
first when it is not (a lent GPU machine reaches no package index).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

try:
    from speedkv.core.engine import Engine, Request
    from speedkv.core.graph_decode import GraphDecode
    from speedkv.core.registry import make_policy
    from speedkv.core.sampling import SamplingParams
    from speedkv.core.spec import split_spec
    from speedkv.hf.loading import LoadedModel
    from speedkv.kernels.attention import (
        decode_attention,
        fused_decode_attention,
        live_flash_decode_attention,
        matmul_decode_attention,
    )
except ModuleNotFoundError as missing:  # a GPU machine has torch and transformers, not speedkv
    if missing.name != "speedkv":
        raise
    sys.exit("speedkv is not importable: run the check from the repository's root as "
             "`PYTHONPATH=src python3 benchmarks/gpu.py ...` (make gpu-check does)")  # fmt: skip

ROOT = Path(__file__).resolve().parents[1]

TEST_FILES = [
    "tests/unit/test_engine_equivalence.py",
    "tests/unit/test_batch.py",
    "tests/integration/test_prefix_reuse.py",
    "tests/unit/test_methods_equivalence.py",
    "tests/unit/test_graph_decode.py",
]
# Llama-3.1-8B: 32 layers, 32 query and 8 KV heads of 128, hidden 4096, MLP 14336
PAPER_SHAPE = dict(
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    hidden_size=4096,
    intermediate_size=14336,
    vocab_size=128256,
    rope_theta=500000.0,
)
TINY_SHAPE = dict(
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    hidden_size=64,
    intermediate_size=128,
    vocab_size=512,
    rope_theta=10000.0,
)
PAPER_LENGTHS = [16384, 32768, 65536, 131072]
# profiler events where the host waits for the device
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "aten::item")
RATIOS = {
    "ttft_s": "ttft_ratio",
    "tpot_s": "tpot_ratio",
    "kv_bytes": "kv_ratio",
    "kv_bytes_final": "kv_final_ratio",
}
TINY_LENGTHS = [64, 128]
# the batched-decode part: sequences decoding together, each with its own prompt
BATCHES, BATCH_LENGTHS, TINY_BATCHES = [8, 32], [16384, 32768], [2, 4]
# a method name ending so decodes without recorded steps: every kernel launched from the host
EAGER = "+eager"
# ... and so decodes through recorded steps that attend by masked matrix products (the engine's
# recorded steps attend by flash attention with device lengths where it agrees with them)
MATMUL = "+matmul"
# ... and so prefills in chunks of 1024 rows instead of the engine's 8192 on a GPU
SMALL_CHUNKS = "+chunk1024"
VARIANTS = (EAGER, MATMUL, SMALL_CHUNKS)
# variants of earlier runs, whose files --table still reads (8192 rows, now the default)
EARLIER_VARIANTS = ("+chunk8192",)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="folder the JSON results go to")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny shape and short prompts")
    p.add_argument("--lengths", help="prompt lengths, comma-separated (default by shape)")
    p.add_argument("--new-tokens", type=int, help="tokens generated per run (64; tiny: 8)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="seconds the efficiency part may take; later runs are skipped",
    )
    p.add_argument(
        "--tests-timeout-s",
        type=float,
        help="seconds the reference tests may take before they are stopped (default: no limit)",
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"the other ways each method runs, comma-separated (default {','.join(VARIANTS)})",
    )
    p.add_argument(
        "--batches",
        help="batch sizes for the batched-decode part, comma-separated (default 8,32; tiny: 2,4)",
    )
    p.add_argument(
        "--batch-lengths", help="prompt lengths of the batched-decode part (default 16K,32K)"
    )
    p.add_argument(
        "--batch-budget-s",
        type=float,
        default=300.0,
        help="seconds the batched-decode part may take; later cells are skipped",
    )
    p.add_argument(
        "--skip",
        default="",
        help="parts to skip: exactness, efficiency, batch, attention, profile",
    )
    p.add_argument("--wheels", type=Path, help="wheel files to install pytest from")
    p.add_argument(
        "--table",
        type=Path,
        metavar="JSON",
        help="print an efficiency.json or batch.json of an earlier run as a markdown table",
    )
    args = p.parse_args(argv)
    if args.table:
        result = json.loads(args.table.read_text())
        batched = any("batch" in row for row in result["runs"])
        print(batch_table(result) if batched else efficiency_table(result))
        return 0
    if args.out is None:
        p.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    facts = machine(args.device)
    log(
        f"device: {facts['device_name']}; torch {facts['torch']}; "
        f"transformers {facts['transformers']}"
    )
    status = 0  # 1 where the reference tests failed or could not run; the rest still runs
    if "exactness" not in skip:
        result = exactness(args)
        if args.device != "cpu":  # again with every decode step the engine takes recorded
            result["exactness_recorded"] = exactness(args, "always").get("exactness", {})
        write(args.out / "exactness.json", {**facts, **result})
        summaries = [v for k, v in result.items() if k.startswith("exactness")] or [{}]
        status = int(any(s.get("returncode") != 0 or s.get("failed", 1) > 0 for s in summaries))
    if skip >= {"efficiency", "batch", "attention", "profile"}:
        return status
    shape = TINY_SHAPE if args.tiny else PAPER_SHAPE
    lengths = ints(args.lengths) or (TINY_LENGTHS if args.tiny else PAPER_LENGTHS)
    new = args.new_tokens or (8 if args.tiny else 64)
    start = time.perf_counter()
    model = random_model(shape, max(lengths + BATCH_LENGTHS) + new, args.device)
    log(f"random model built in {time.perf_counter() - start:.1f} s")
    lcut = shape["num_hidden_layers"] * 3 // 4  # the paper's 24 of 32
    methods = ["full", f"speed:lcut={lcut},anchors=bos,deep=1"]  # the paper's suffix
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    methods += [m + v for v in variants for m in methods]  # the same, run otherwise
    if "efficiency" not in skip:
        path = args.out / "efficiency.json"
        result = efficiency(
            model, methods, lengths, new, args.budget_s,
            save=lambda partial: path.write_text(json.dumps({**facts, "shape": shape, **partial})),
        )  # fmt: skip
        write(path, {**facts, "shape": shape, **result})
    if "batch" not in skip:
        batches = ints(args.batches) or (TINY_BATCHES if args.tiny else BATCHES)
        batch_lengths = ints(args.batch_lengths) or (TINY_LENGTHS if args.tiny else BATCH_LENGTHS)
        path = args.out / "batch.json"
        result = batched_decode(
            model, methods[:2], batches, batch_lengths, new, args.batch_budget_s,
            save=lambda partial: path.write_text(json.dumps({**facts, "shape": shape, **partial})),
        )  # fmt: skip
        write(path, {**facts, "shape": shape, **result})
    if "attention" not in skip:
        result = decode_attention_kernels(shape, [min(lengths), max(lengths)], args.device)
        write(args.out / "attention.json", {**facts, **result})
    if "profile" not in skip:
        plain = [m for m in methods if not m.endswith(VARIANTS)]
        write(args.out / "profile.json", {**facts, **profile(model, plain, min(lengths))})
    return status


def ints(text: str | None) -> list[int]:
    """A comma-separated list of integers; empty for none given."""
    return [int(part) for part in (text or "").split(",") if part.strip()]


# -- the reference tests on the device -----------------------------------------------------------
def exactness(args, recorded_decode: str | None = None) -> dict:
    """The reference tests on `args.device`; with `recorded_decode`, the engine's decode mode
    for them (Engine's recorded_decode, through SPEEDKV_RECORDED_DECODE)."""
    if importlib.util.find_spec("pytest") is None:
        if args.wheels is None:
            return {"error": "pytest is not installed here; give --wheels DIR"}
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--no-index",
                "--find-links",
                str(args.wheels),
                "pytest",
            ],
            check=True,
        )
    report = args.out / "exactness.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        *TEST_FILES,
        "--device",
        args.device,
        "-m",
        "not real_model",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    env.pop("PYTEST_ADDOPTS", None)  # the check's own options: a caller's could break or narrow it
    if args.device != "cpu":  # the native kernels are CPU code: not built where they never run
        env["SPEEDKV_KERNELS"] = "torch"
    if recorded_decode is not None:
        env["SPEEDKV_RECORDED_DECODE"] = recorded_decode
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=args.tests_timeout_s,
        )  # fmt: skip
        said = done.stdout + done.stderr
        returncode, tail = done.returncode, said[-3000:] if done.returncode else ""
    except subprocess.TimeoutExpired as stopped:
        out = stopped.stdout.decode() if isinstance(stopped.stdout, bytes) else stopped.stdout
        returncode, tail = "timeout", (out or "")[-3000:]
    seconds = time.perf_counter() - start
    outcomes = read_junit(report) if report.exists() else {}
    failed = {name: why for name, why in outcomes.items() if why not in ("passed", "skipped")}
    summary = {
        "passed": sum(why == "passed" for why in outcomes.values()),
        "skipped": sum(why == "skipped" for why in outcomes.values()),
        "failed": len(failed),
        "seconds": round(seconds, 1),
        "returncode": returncode,
        "failures": failed,
        "tail": tail,
    }
    report.unlink(missing_ok=True)
    if returncode not in (0, 1):  # pytest's codes for "the tests ran"
        last = tail.strip().splitlines()[-1:] or ["no output"]
        log(f"the reference tests did not run on {args.device} ({returncode}): {last[0]}")
    log(
        f"reference tests on {args.device}"
        f"{f' (recorded decode: {recorded_decode})' if recorded_decode else ''}: "
        f"{summary['passed']} passed, "
        f"{summary['failed']} failed, {summary['skipped']} skipped in {seconds:.0f} s"
    )
    return {"exactness": summary}


def read_junit(path: Path) -> dict[str, str]:
    """Each test case's outcome from pytest's JUnit XML: passed, skipped, or the failure."""
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        problem = next((c for c in case if c.tag in ("failure", "error")), None)
        skipped = any(c.tag == "skipped" for c in case)
        outcomes[name] = (
            problem.get("message", "failed")[:500]
            if problem is not None
            else "skipped"
            if skipped
            else "passed"
        )
    return outcomes


# -- efficiency at the paper's shape ---------------------------------------------------------------
def random_model(shape: dict, positions: int, device: str) -> LoadedModel:
    """A Llama of `shape` with transformers' own random initialisation, built directly on the
    device in bfloat16 (an 8B model never exists in float32 or on the host)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **shape,
        max_position_embeddings=positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    hf.to(device).eval().requires_grad_(False)  # buffers HF made on the host, if any
    return LoadedModel(name="random-llama", hf_model=hf, tokenizer=None, source="memory")


def prompt(length: int, vocab: int, seed: int) -> list[int]:
    """Random ids after a BoS token (SPEED's anchor is position 0)."""
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(3, vocab, (length - 1,), generator=g).tolist()


def efficiency(
    model: LoadedModel,
    methods: list[str],
    lengths: list[int],
    new: int,
    budget_s: float,
    save=lambda partial: None,
) -> dict:
    """Every method at every length, the longest first (the paper's headline is the longest;
    a run cut short by the budget loses the short ones). `save` gets the rows so far after
    each run, so a check stopped from outside still leaves them."""
    engines = {
        "": Engine(model),
        EAGER: Engine(model, recorded_decode="never"),
        MATMUL: Engine(model, recorded_attention="matmul"),
        SMALL_CHUNKS: Engine(model, chunk_size=1024),
    }
    vocab, layers = model.shape.vocab_size, model.shape.num_layers

    def run_one(method: str, ids: list[int], new: int) -> dict:
        variant = variant_of(method)
        return timed_run(engines[variant], method.removesuffix(variant), ids, new)

    for method in [*methods, "hf"]:  # first-call costs (kernel selection, allocator) out
        run_one(method, prompt(min(lengths), vocab, 0), 4)
    start, rows = time.perf_counter(), []
    for n in sorted(lengths, reverse=True):
        ids = prompt(n, vocab, n)
        for method in [*methods, "hf"]:
            if time.perf_counter() - start > budget_s:
                rows.append({"method": method, "length": n, "status": "skipped: time budget"})
                continue
            row = {"method": method, "length": n, **run_one(method, ids, new)}
            rows.append(row)
            save({"runs": rows})
            log(
                f"{method} @ {n}: {row['status']}, TTFT {row.get('ttft_s')}, "
                f"TPOT {row.get('tpot_s')}, KV {row.get('kv_bytes')}"
            )
    for row in rows:  # same-run ratios against full, decoding the same way
        reference = "full" + variant_of(row["method"])
        base = next(
            (
                r
                for r in rows
                if r["method"] == reference
                and r["length"] == row["length"]
                and r.get("status") == "ok"
            ),
            None,
        )
        if base and row.get("status") == "ok":
            for key, ratio in RATIOS.items():
                if row[key] is not None:
                    row[ratio] = row[key] / base[key]
    lcut = make_policy(methods[1], model.shape).rule.lcut
    limits = {
        n: {"ttft": lcut / layers, "kv": kv_entries(methods[1], model.shape, n, 0) / (layers * n)}
        for n in lengths
    }
    return {
        "methods": [*methods, "hf"],
        "new_tokens": new,
        "runs": rows,
        "layer_limits": limits,
        "seconds": round(time.perf_counter() - start, 1),
    }


def variant_of(method: str) -> str:
    """The way a method name says to decode (one of VARIANTS), or "" for the engine's own."""
    return next((v for v in (*VARIANTS, *EARLIER_VARIANTS) if method.endswith(v)), "")


def timed_run(engine: Engine, method: str, ids: list[int], new: int) -> dict:
    """One timed generation; out-of-memory is a result, not a crash. TPOT counts the
    recording of the decode step where the engine records one."""
    device = engine.device
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        if method == "hf":  # its cache is read once, at the end
            tensor = torch.tensor([ids], device=device)
            r = engine.backbone.hf_generate_timed(tensor, new)
            row = {
                "ttft_s": r["ttft_s"],
                "tpot_s": r["tpot_s"],
                "kv_bytes": None,
                "kv_bytes_final": r["kv_bytes_final"],
            }
        else:
            policy = make_policy(method, engine.shape)
            sampling = SamplingParams(max_new_tokens=new, ignore_eos=True)
            g = engine.generate([Request(ids, policy, sampling)])[0]
            row = {
                "ttft_s": g.ttft_s,
                "tpot_s": g.tpot_s,
                "kv_bytes": g.kv_bytes,
                "kv_bytes_final": g.kv_bytes_final,
            }
    except torch.OutOfMemoryError:
        return {"status": "out of memory"}
    except (RuntimeError, ValueError) as error:  # one failed run is a row, not the end
        log(f"{method} failed: {error!r}")
        return {"status": f"failed: {str(error).splitlines()[0][:200]}"}
    row["status"] = "ok"
    if device.type == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return row


# The chips' peak figures, from NVIDIA's H100 and H200 datasheets (SXM): HBM bandwidth, and
# dense bfloat16 tensor throughput (the datasheets' 1,979 TFLOP/s counts 2:4 sparsity)
CHIPS = {
    "NVIDIA H200": {"bytes_per_s": 4.8e12, "flop_per_s": 989e12},
    "NVIDIA H100 80GB HBM3": {"bytes_per_s": 3.35e12, "flop_per_s": 989e12},
}


def layer_params(shape: dict) -> int:
    """Weights one layer multiplies by: Q, K, V, O and the gated MLP's three."""
    hidden, dim = shape["hidden_size"], shape["head_dim"]
    q = shape["num_attention_heads"] * dim
    kv = shape["num_key_value_heads"] * dim
    return hidden * (2 * q + 2 * kv) + 3 * hidden * shape["intermediate_size"]


def bounds(shape: dict, method: str, n: int, kv_bytes: int, chip: dict) -> dict:
    """The fastest the chip allows. TTFT: the prefill's matrix work (2 FLOPs a weight a row in
    the layers that run the prompt, and causal attention's 2 * N^2 * heads * dim a layer) at
    the chip's dense bfloat16 rate. TPOT: one step's bytes (every weight but the embedding
    table, in bfloat16, and the cache after prefill) at the chip's memory bandwidth."""
    layers = shape["num_hidden_layers"]
    name, options = split_spec(method.removesuffix(variant_of(method)))
    deep = int(options["lcut"]) if name == "speed" else layers
    heads_dim = shape["num_attention_heads"] * shape["head_dim"]
    flops = deep * (2 * layer_params(shape) * n + 2 * n * n * heads_dim)
    weights = 2 * (layers * layer_params(shape) + shape["vocab_size"] * shape["hidden_size"])
    return {
        "ttft_bound_s": flops / chip["flop_per_s"],
        "tpot_bound_s": (weights + kv_bytes) / chip["bytes_per_s"],
    }


def efficiency_table(result: dict) -> str:
    """efficiency.json as a markdown table: one row per length and method, same-run ratios
    against `full` run the same way, SPEED's layer limits, and on a chip of CHIPS the bounds
    (`bounds`) with each time's multiple of them."""
    label = {"hf": "transformers `generate` (SDPA)"}
    chip = CHIPS.get(result["device_name"])
    lines = [
        f"{result['device_name']}, torch {result['torch']}, transformers "
        f"{result['transformers']}; batch 1, {result['new_tokens']} new tokens.",
        "",
        "| prompt | method | TTFT s | TPOT ms | KV GiB | TTFT ratio | TPOT ratio | KV ratio "
        "| KV limit | TTFT bound s (x) | TPOT bound ms (x) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in sorted(result["runs"], key=lambda r: r["length"]):
        n, method = row["length"], row["method"]
        if row.get("status") != "ok":
            lines.append(f"| {n // 1024}K | {label.get(method, method)} | {row['status']} |")
            continue
        kv = row["kv_bytes"] if row["kv_bytes"] is not None else row["kv_bytes_final"]
        limit = result["layer_limits"][str(n)]["kv"] if method.startswith("speed") else None
        bound = ["", ""]
        if chip and method != "hf":
            b = bounds(result["shape"], method, n, kv, chip)
            bound = [
                f"{b['ttft_bound_s']:.2f} ({row['ttft_s'] / b['ttft_bound_s']:.2f}x)",
                f"{1e3 * b['tpot_bound_s']:.2f} ({row['tpot_s'] / b['tpot_bound_s']:.2f}x)",
            ]
        cells = [
            f"{n // 1024}K",
            label.get(method, f"`{method}`"),
            f"{row['ttft_s']:.2f}",
            f"{1e3 * row['tpot_s']:.1f}",
            f"{kv / 2**30:.2f}",
            *(
                f"{row[key]:.3f}" if key in row else ""
                for key in ("ttft_ratio", "tpot_ratio", "kv_ratio")
            ),
            f"{limit:.4f}" if limit else "",
            *bound,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def batch_table(result: dict) -> str:
    """batch.json as a markdown table: decode tokens a second per cell, with the same-run
    ratio against `full` and the step-time bound's tokens a second on a chip of CHIPS."""
    chip = CHIPS.get(result["device_name"])
    lines = [
        f"{result['device_name']}, torch {result['torch']}; {result['new_tokens']} new tokens "
        "a sequence; tokens/s over every decode step (the recording included), and from the "
        "second step (replays only).",
        "",
        "| prompt | batch | method | KV GiB | decode tokens/s | replays only | ratio "
        "| bound tokens/s | peak GiB |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in sorted(result["runs"], key=lambda r: (r["length"], r["batch"])):
        n, batch, method = row["length"], row["batch"], row["method"]
        head = f"| {n // 1024}K | {batch} | `{method}` |"
        if row.get("status") != "ok":
            lines.append(f"{head} {row['status']} |")
            continue
        bound = ""
        if chip:  # one step reads the weights once and every sequence's cache
            b = bounds(result["shape"], method, n, row["kv_bytes"], chip)
            bound = f"{batch / b['tpot_bound_s']:.0f}"
        ratio = row.get("tokens_per_s_ratio")
        lines.append(
            f"{head} {row['kv_bytes'] / 2**30:.1f} | {row['tokens_per_s']:.0f} | "
            f"{row['tokens_per_s_replayed']:.0f} | {f'{ratio:.3f}' if ratio else ''} | "
            f"{bound} | {row.get('peak_gib', '')} |"
        )
    return "\n".join(lines)


# -- batches ------------------------------------------------------------------------------------
def batched_decode(
    model: LoadedModel,
    methods: list[str],
    batches: list[int],
    lengths: list[int],
    new: int,
    budget_s: float,
    save=lambda partial: None,
) -> dict:
    """Decode throughput of `full` against SPEED with `batch` sequences of `length` random
    tokens decoding together, as the engine runs a list of requests: each prompt prefilled in
    turn, then one decode step for the whole batch at a time (on a GPU, recorded). A cell
    whose caches would not fit in the device's free memory is recorded as such, not run."""
    engine = Engine(model)
    shape = engine.shape
    vocab = shape.vocab_size
    rows, start = [], time.perf_counter()
    for n in lengths:
        for batch in batches:
            for method in methods:
                row = {"method": method, "length": n, "batch": batch}
                need = batch * kv_entries(method, shape, n, new) * kv_entry_bytes(shape)
                free = free_bytes(engine.device)
                if time.perf_counter() - start > budget_s:
                    row["status"] = "skipped: time budget"
                elif free is not None and need + HEADROOM > free:
                    row["status"] = (
                        f"does not fit: its caches need {need / 2**30:.1f} GiB, "
                        f"{free / 2**30:.1f} GiB free"
                    )
                else:
                    prompts = [prompt(n, vocab, n + i) for i in range(batch)]
                    row.update(timed_batch(engine, method, prompts, new))
                rows.append(row)
                save({"runs": rows})
                log(f"{method} @ {n} x {batch}: {row.get('status')}, "
                    f"{row.get('tokens_per_s')} tokens/s")  # fmt: skip
    for row in rows:  # same-run ratios against full at the same length and batch
        base = next(
            (r for r in rows if r["method"] == "full" and r["length"] == row["length"]
             and r["batch"] == row["batch"] and r.get("status") == "ok"),
            None,
        )  # fmt: skip
        if base and row.get("status") == "ok":
            for key in ("tokens_per_s", "tokens_per_s_replayed", "kv_bytes"):
                row[f"{key}_ratio"] = row[key] / base[key]
    return {"methods": methods, "new_tokens": new, "runs": rows,
            "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip


# memory a batch needs beyond its caches: weights are already held; activations of one
# prefill chunk, the packed copy of one layer when a step is recorded, the allocator's slack
HEADROOM = 6 * 2**30


def kv_entries(method: str, shape, n: int, new: int) -> int:
    """Cache entries (over all layers, per KV head) one sequence holds at its last token."""
    if method == "full":
        return shape.num_layers * (n + new)
    rule = make_policy(method, shape).rule
    upper = int(rule.anchors) + int(rule.deep) + new
    return rule.lcut * (n + new) + (shape.num_layers - rule.lcut) * upper


def kv_entry_bytes(shape) -> int:
    """Bytes of one entry's keys and values over all KV heads, in bfloat16."""
    return 2 * shape.num_kv_heads * shape.head_dim * 2


def free_bytes(device: torch.device) -> int | None:
    """Free device memory (after emptying torch's cache), or None off a GPU."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def timed_batch(engine: Engine, method: str, prompts: list[list[int]], new: int) -> dict:
    """One batched generation: prefill time, decode time for the whole batch (the recording
    counted, as in TPOT) and from the second step on (replays only), and tokens a second."""
    device = engine.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sampling = SamplingParams(max_new_tokens=new, ignore_eos=True)
    requests = [Request(ids, make_policy(method, engine.shape), sampling) for ids in prompts]
    batch, seen, kv = len(prompts), 0, 0
    marks: dict[int, float] = {}
    try:
        sync(device)
        marks[0] = time.perf_counter()
        for event in engine.run(requests):
            seen += 1
            if seen in (batch, 2 * batch):  # every first token out; the first step taken
                sync(device)
                marks[seen] = time.perf_counter()
            if event.finished is not None:
                kv += event.finished.kv_bytes
        sync(device)
        end = time.perf_counter()
    except torch.OutOfMemoryError as error:  # where, and torch's account of the memory
        where = f"prefilling prompt {seen + 1}" if seen < batch else f"decoding, event {seen}"
        return {"status": f"out of memory {where}", "error": str(error)[:600]}
    except (RuntimeError, ValueError) as error:
        log(f"{method} x {batch} failed: {error!r}")
        return {"status": f"failed: {str(error).splitlines()[0][:200]}"}
    decode_s = end - marks[batch]
    replayed_s = end - marks[2 * batch]
    row = {
        "status": "ok",
        "prefill_s": marks[batch] - marks[0],
        "decode_s": decode_s,
        "tokens_per_s": batch * (new - 1) / decode_s,
        "tokens_per_s_replayed": batch * (new - 2) / replayed_s,
        "kv_bytes": kv,
    }
    if device.type == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return row


# -- decode attention alone -----------------------------------------------------------------------
def decode_attention_kernels(shape: dict, lengths: list[int], device: str, calls: int = 64) -> dict:
    """One decode query's attention over one layer's cache at `shape`, by each candidate: the
    engine's batched matrix products, and torch's fused attention with the backend it picks
    and with each backend forced. Time per call (host launch included) and the rate the
    cache's keys and values were read at."""
    from torch.nn.attention import SDPBackend

    heads, kv_heads, dim = (
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
        shape["head_dim"],
    )
    candidates = {
        "the engine's": decode_attention,
        "matmul": lambda q, k, v: matmul_decode_attention(q, k, v, per_head=False),
        "sdpa, torch's choice": fused_decode_attention,
    }
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        backend = getattr(SDPBackend, name)
        candidates[f"sdpa, {name.lower()}"] = functools.partial(
            fused_decode_attention, backend=backend
        )
    rows = []
    for n in lengths:
        g = torch.Generator(device=device).manual_seed(n)
        room = n + 64  # a cache buffer with room left, as the engine's
        k = torch.randn((kv_heads, room, dim), generator=g, device=device, dtype=torch.bfloat16)
        v = torch.randn((kv_heads, room, dim), generator=g, device=device, dtype=torch.bfloat16)
        q = torch.randn((heads, 1, dim), generator=g, device=device, dtype=torch.bfloat16)
        live = torch.tensor([n], dtype=torch.int32, device=device)
        starts = (  # flash's offsets of the query and of the buffer
            torch.tensor([0, 1], dtype=torch.int32, device=device),
            torch.tensor([0, room], dtype=torch.int32, device=device),
        )
        buffers = {  # read through the whole buffer, as a recorded step must
            "flash, device length (recordable)": functools.partial(
                one_flash_query, k=k, v=v, live=live, starts=starts, width=room
            ),
            "matmul, masked (recordable)": lambda q, _k, _v, kb=k, vb=v, live=live: (
                matmul_decode_attention(q, kb, vb, per_head=False, live=live)
            ),
        }
        k, v = k[:, :n], v[:, :n]
        reference = matmul_decode_attention(q, k, v, per_head=True).float()
        for name, fn in {**candidates, **buffers}.items():
            row = {"kernel": name, "length": n}
            try:
                err = (fn(q, k, v).float() - reference).abs().max().item()
                sync(torch.device(device))
                start = time.perf_counter()
                for _ in range(calls):
                    fn(q, k, v)
                sync(torch.device(device))
                seconds = (time.perf_counter() - start) / calls
                row.update(
                    us=round(1e6 * seconds, 1),
                    gb_per_s=round(2 * k.numel() * k.element_size() / seconds / 1e9, 1),
                    max_abs_diff=err,
                )
            except (RuntimeError, TypeError) as error:  # a backend or op not available here
                row["unavailable"] = str(error).splitlines()[0][:200]
            rows.append(row)
            log(f"decode attention @ {n}, {name}: {row.get('us', row.get('unavailable'))}")
        del k, v
    return {"decode_attention": rows}


def one_flash_query(q, _k, _v, k, v, live, starts, width) -> torch.Tensor:
    """One sequence's query [heads, 1, D] through the batch kernel of a recorded step."""
    return live_flash_decode_attention(q.transpose(0, 1), k, v, live, starts, width).transpose(0, 1)


# -- where a step's time goes -------------------------------------------------------------------
def profile(model: LoadedModel, methods: list[str], length: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    engine = Engine(model)
    device = engine.device
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    ids = prompt(length, model.shape.vocab_size, 7)
    result = {"length": length}
    for method in methods:
        policy = make_policy(method, model.shape)
        done = engine.prefill_ids(ids, policy, spare=16)  # warm; room for the steps below

        def plain_step(i, cache=done.cache, policy=policy):
            engine.decode_step([cache], [policy], [5], [length + i])

        parts = {"decode_step_ms": step_times(plain_step, device)}
        fresh = make_policy(method, model.shape)
        done = engine.prefill_ids(ids, fresh, spare=16)
        try:
            graph = GraphDecode(engine, [done.cache], [fresh], [done.next_position], 6)
            parts["recorded_step_ms"] = step_times(lambda i, g=graph: g.step([5]), device)
            parts["recorded_attention"] = graph.attention
        except RuntimeError as error:  # the efficiency rows say what it cost the engine
            parts["recorded_step_ms"] = {"failed": str(error).splitlines()[0][:200]}
        for part in ("prefill", "decode"):
            with torch_profile(activities=activities) as prof:
                if part == "prefill":
                    done = engine.prefill_ids(ids, policy, spare=4)
                else:
                    engine.decode_step([done.cache], [policy], [5], [length])
                sync(device)
            parts[part] = summarise(prof, device.type == "cuda")
        result[method] = parts
    return result


def step_times(run_step, device: torch.device, steps: int = 6) -> dict:
    """Medians over `steps` calls of `run_step(i)` (one decode step each) of the host's time
    to issue one (`host`) and the time until the device has finished it (`wall`): equal when
    the step is bound by the host's launches, `wall` larger when by the device's work. The
    first call warms and is left out."""
    host, wall = [], []
    for step in range(steps):
        sync(device)
        start = time.perf_counter()
        run_step(step)
        issued = time.perf_counter()
        sync(device)
        host.append(issued - start)
        wall.append(time.perf_counter() - start)
    host, wall = host[1:], wall[1:]
    return {
        "host": round(1e3 * sorted(host)[len(host) // 2], 3),
        "wall": round(1e3 * sorted(wall)[len(wall) // 2], 3),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def summarise(prof, cuda: bool) -> dict:
    """The operators with the most device time (CPU time on a CPU) and the host's waits."""
    events = prof.key_averages()
    attr = "device_time_total" if cuda else "cpu_time_total"
    top = sorted(events, key=lambda e: getattr(e, attr, 0.0), reverse=True)[:15]
    waits = sum(e.count for e in events if any(w in e.key for w in WAITS))
    host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    return {
        "top": [
            {"op": e.key, "ms": round(getattr(e, attr, 0.0) / 1e3, 3), "calls": e.count}
            for e in top
        ],
        "host_top": [
            {"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3, 3), "calls": e.count}
            for e in host
        ],
        "host_waits": waits,
        "launches": sum(e.count for e in events if "cudaLaunchKernel" in e.key),
    }


def machine(device: str) -> dict:
    import transformers

    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    return {
        "device": device,
        "device_name": name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def write(path: Path, record: dict) -> None:
    path.write_text(json.dumps(record, indent=2))
    log(f"wrote {path}")


def log(message: str) -> None:
    print(f"[gpu-check] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
